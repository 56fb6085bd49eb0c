"""The model's own MTP layer as the drafter of speculative decoding (afdc.mtp), compiled into the
artifact and run as afdc's vLLM worker runs it, against vLLM's MTP math on transformers' own
reading of the checkpoint; served through `afdc up` at k = 0, 1 and 2 by one server (greedy
outputs unchanged); and refused, saying why, where afdc compiles no drafter or would ignore a
setting."""

from __future__ import annotations

import itertools
import json
import re
import urllib.request

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from afdc.artifact.load import load, load_with_drafter
from afdc.artifact.manifest import read_manifest
from afdc.compile import compile_model
from afdc.demo import save_demo_mtp
from afdc.mtp import attach
from afdc.runtime.attention_rank import AttentionRank, MicroBatch
from afdc.runtime.flat_batches import prepare_for_flat_batches
from afdc.runtime.paged import PagedBatch, PagedKVStore
from afdc.serve.mtp_drafter import MtpDrafts, first_pass

BLOCK = 4


@pytest.fixture(scope="module")
def mtp_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    save_demo_mtp(root / "model")
    compile_model(str(root / "model"), "1A2F", root / "art", progress=False)
    return root


def _reference(model_dir):
    """The model and its MTP layer as transformers reads the checkpoint: the MTP layer's decoder
    layer loaded as a fourth decoder layer (transformers' own conversion of its experts), its
    enorm, hnorm, eh_proj and shared_head as stored."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, num_hidden_layers=4, dtype=torch.float32).eval()
    layer = model.model.layers[3]
    model.model.layers = model.model.layers[:3]
    model.config.num_hidden_layers = 3
    mtp = attach(model)
    mtp.load_state_dict(layer.state_dict(), strict=False)
    stored = load_file(model_dir / "model.safetensors")
    with torch.no_grad():
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "shared_head.head.weight"):
            mtp.get_parameter(name).copy_(stored[f"model.layers.3.{name}"])
    return model, mtp


@torch.no_grad()
def _vllm_drafts(model, mtp, tokens: list[int], k: int) -> list[int]:
    """vLLM's MTP drafting (deepseek_mtp.py, llm_base_proposer.py) over the whole sequence: position
    p takes the token at p + 1 and the target's last hidden state (its LM head's input) at p; each
    further draft its previous draft and the drafter's own LM-head input at the position before."""
    ids = torch.tensor([tokens])
    hidden = model.model(input_ids=ids).last_hidden_state[0]  # the LM head's input at every position
    rotary = model.model.rotary_emb
    inputs, previous, drafts = tokens[1:], list(hidden[:-1]), []
    for _ in range(k):
        n = len(inputs)
        positions = torch.arange(n)[None]
        embeds = model.model.embed_tokens(torch.tensor([inputs]))
        embeds = torch.where(positions[..., None] == 0, 0, embeds)
        x = mtp.eh_proj(torch.cat([mtp.enorm(embeds), mtp.hnorm(torch.stack(previous)[None])], -1))
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = mtp(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, positions))
        recycled = mtp.shared_head.norm(y)[0]
        drafts.append(int(mtp.shared_head.head(recycled[-1]).argmax()))
        inputs, previous = [*inputs, drafts[-1]], [*previous, recycled[-1]]
    return drafts


def _paged(store, tokens: list[list[int]], computed: list[int], logit_rows=None):
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(tokens))]
    paged = PagedBatch(store, torch.tensor(tables), torch.tensor(computed), torch.tensor([len(t) for t in tokens]),
                       logit_rows=logit_rows)
    flat = torch.tensor([t for row in tokens for t in row])[None]
    return MicroBatch(flat, torch.ones_like(flat), paged.positions, paged), tables


def test_mtp_layer_is_compiled_and_drafts_as_vllm_does(mtp_artifact):
    """The drafter is captured from the checkpoint's MTP layer and split like any decoder layer:
    its MoE is the FFN program's last layer, its experts shared out over the two FFN ranks. Run as
    the worker runs it (the model's step keeps its LM-head inputs, the drafter's passes on a paged
    cache of its own), its drafts for two requests of different lengths are vLLM's, k = 3."""
    root = mtp_artifact
    art = root / "art"
    manifest = read_manifest(art)
    assert manifest.drafter is not None and manifest.drafter.layers == [len(manifest.layers) - 1]
    last = manifest.layers[-1]
    assert last.module == "model.layers.3" and last.kind == "moe" and last.ffn_split == "ep"
    ffn = [load(art, "ffn", r) for r in range(2)]
    halves = [{n: w.shape[0] for n, w in p._weights.items() if n.startswith("model.layers.3.mlp.experts")} for p in ffn]
    assert halves[0] and all(n == 8 // 2 for h in halves for n in h.values()), halves  # 8 experts, 4 per FFN rank

    cpu = torch.device("cpu")
    program, drafter = load_with_drafter(art)
    slots, drafter_slots = (prepare_for_flat_batches(p, "eager", cpu, mixers=[]).slots for p in (program, drafter))
    dispatch = [manifest.segments[lay.segment].dispatch() for lay in manifest.layers]
    rank = AttentionRank(0, program, ffn, dispatch)
    store = PagedKVStore(slots, 16, BLOCK, torch.float32, cpu)
    drafts = MtpDrafts(drafter, PagedKVStore(drafter_slots, 16, BLOCK, torch.float32, cpu), k=3)

    model, mtp = _reference(root / "model")
    prompts = [[5, 9, 17, 33, 2, 71, 8, 100, 41], [300, 12, 12, 7]]
    # the prefill step: every prompt token; the model's own next token is sampled greedily
    batch, tables = _paged(store, prompts, [0, 0])
    batch.cache.keep_hidden = True
    (out,), _ = rank.run(0, [batch])
    sampled = out.logits[0].argmax(-1).tolist()
    tokens = [[*p, s] for p, s in zip(prompts, sampled)]
    hidden = batch.cache.hidden[0]
    want_hidden = torch.cat([model.model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts])
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-4, atol=1e-4)
    rows = first_pass([0, 0], [len(p) for p in prompts], [0, 0], tokens, [[s] for s in sampled], [True, True])

    def run(batches, program):
        return rank.run(0, batches, program)[0]

    got = drafts.propose(rows, hidden, [0, len(prompts[0])], tables, 3, run)
    assert got == {i: _vllm_drafts(model, mtp, t, 3) for i, t in enumerate(tokens)}
    print("drafts", got)


def _metric(metrics: str, name: str) -> float:
    """A Prometheus counter of vLLM's /metrics text, summed over its labels."""
    return sum(float(m) for m in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", metrics, re.M))


# vLLM's dynamic speculative decoding: the drafts per request of a step by the step's batch size
# (its first token: 1 request, none; 2 requests, 1; 3 or more, 2), so one server serves k = 0, 1, 2
BY_BATCH_SIZE = [[1, 1, 0], [2, 2, 1], [3, 64, 2]]


@pytest.mark.slow
def test_served_with_mtp_greedy_tokens_are_the_models(mtp_artifact, tmp_path):
    """`afdc up` of the MTP artifact (1A2F, over shared memory) with vLLM's `--speculative-config`
    MTP named as vLLM names DeepSeek's ("deepseek_mtp"; "mtp" is the same method), k = 2 with a
    batch-size schedule: each prompt served alone (no drafts: serving without speculation), two
    together (k = 1) and three (k = 2, the steps before the third joined k = 1) give the same
    greedy token ids, afdc's own generation's; the drafts per draft are checked from vLLM's
    counters. Random MTP weights draft few tokens the model accepts: the acceptance rate and the
    tokens per FFN round trip are logged, not asserted (benchmarks/bench_serve.py reports them)."""
    pytest.importorskip("vllm")
    openai = pytest.importorskip("openai")
    from afdc.artifact.load import load_deployment
    from afdc.runtime.options import RuntimeOptions
    from afdc.runtime.rendezvous import free_port
    from afdc.serve.settings import WorkerSettings
    from afdc.serve.up import Deployment

    art = mtp_artifact / "art"
    prompts, new = [[5, 9, 17, 33, 2, 71, 8, 100, 41], [300, 12, 12, 7], list(range(40, 60))], 12
    dm = load_deployment(art)
    want = [dm.generate(torch.tensor([p]), max_new_tokens=new, eos_token_id=[])[0, len(p):].tolist() for p in prompts]
    options = RuntimeOptions(connector="shm", rendezvous=f"127.0.0.1:{free_port()}", timeout=60)
    spec = json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 2,
                       "num_speculative_tokens_per_batch_size": BY_BATCH_SIZE})
    d = Deployment(art, WorkerSettings(str(art), options), port=free_port(), log_dir=tmp_path,
                   vllm_args=("--max-model-len", "128", "--max-num-seqs", "64", "--api-server-count", "1",
                              "--speculative-config", spec))
    names = ("drafts", "draft_tokens", "accepted_tokens")
    counts, got = [], {}
    try:
        url = d.start(480.0, print)  # a loaded host starts vLLM and its MTP draft config slowly
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120)
        model = client.models.list().data[0].id

        def complete(batch):
            r = client.completions.create(model=model, prompt=batch, max_tokens=new, temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            return [[int(t.removeprefix("token_id:")) for t in c.logprobs.tokens] for c in r.choices]

        def counters():
            metrics = urllib.request.urlopen(f"{url}/metrics").read().decode()
            counts.append([_metric(metrics, f"vllm:spec_decode_num_{n}_total") for n in names])
            return metrics

        counters()
        got["alone"] = [complete([p])[0] for p in prompts]
        counters()
        got["k=1"] = complete(prompts[:2])
        counters()
        got["k=2"] = complete(prompts)
        metrics = counters()
    finally:
        d.stop()
    assert got == {"alone": want, "k=1": want[:2], "k=2": want}
    (drafts0, tokens0, _), (drafts1, tokens1, _), (drafts2, tokens2, _) = [
        [b - a for a, b in zip(x, y)] for x, y in itertools.pairwise(counts)]
    assert drafts0 == tokens0 == 0  # a batch of one: no speculation
    assert drafts1 > 0 and tokens1 == drafts1  # two requests: one draft each
    assert drafts2 > 0 and tokens2 > 1.5 * drafts2, (drafts2, tokens2)  # three: two each (one until all joined)
    drafted, accepted = counts[-1][1], counts[-1][2]
    steps = _metric(metrics, "vllm:iteration_tokens_total_count")
    tokens = _metric(metrics, "vllm:generation_tokens_total")
    print(f"MTP k=1, 2: {accepted:g} of {drafted:g} drafts accepted ({accepted / drafted:.0%}); "
          f"{tokens:g} tokens in {steps:g} steps")


def test_the_drafters_first_pass_takes_the_positions_whose_next_token_is_known():
    """After a step: a decode that ran its last token and 3 drafts and kept 2 of them plus the
    model's token covers its last token and the 2 kept drafts (the token after each: the next one,
    the last's the model's); one that kept none its last token (the token after: the model's); a
    prefill chunk short of its prompt its chunk (the prompt's next tokens), proposing nothing."""
    tokens = [[1, 2, 3, 10, 11, 12], [4, 5, 20], [7, 8, 9, 6, 5]]
    rows = first_pass(computed=[2, 1, 0], scheduled=[4, 2, 3], drafted=[3, 1, 0], tokens=tokens,
                      kept=[[10, 11, 12], [20], None], proposes=[True, True, True])
    assert [(r.start, r.ids, r.drafts) for r in rows] == [(2, [10, 11, 12], True), (1, [20], True),
                                                          (0, [8, 9, 6], False)]


def test_mtp_the_drafter_cannot_run_with_is_refused_before_vllm_starts(tmp_path):
    """A model with MTP layers compiled for what afdc's drafter does not run gets no drafter, the
    manifest saying why, every reason: here DeepSeek-V3.2's sparse-attention indexers and --attn-tp
    2, in one plan-only compile (a quantized checkpoint's reason: test_quantized_checkpoints.py).
    `afdc serve` / `afdc up` refuse `--speculative-config` MTP with those reasons before vLLM
    starts; n-gram speculation stays served."""
    from transformers import AutoConfig

    from afdc.errors import AfdcError
    from afdc.plan import Plan
    from afdc.serve.up import check_speculation
    from models_supported.catalog import entry

    config = AutoConfig.for_model("deepseek_v32", **entry("deepseek_v32").config_kwargs, num_nextn_predict_layers=1)
    config.save_pretrained(tmp_path / "model")
    manifest = compile_model(str(tmp_path / "model" / "config.json"), Plan.parse("1A1F", attention_tp=2),
                             tmp_path / "art", weights=False, progress=False)
    reasons = ("--attn-tp 2", "sparse-attention indexers", "without weights")
    assert manifest.drafter is None and all(r in manifest.no_drafter for r in reasons), manifest.no_drafter
    with pytest.raises(AfdcError, match="multi-token-prediction layers, which this artifact does not hold") as refused:
        check_speculation(manifest, ("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'))
    assert all(r in str(refused.value) for r in reasons) and "ngram" in str(refused.value), refused.value
    check_speculation(manifest, ("-sc", '{"method": "ngram", "num_speculative_tokens": 2}'))


def test_speculative_settings_afdc_would_ignore_are_refused():
    """A --speculative-config setting that changes how drafts are made or checked, or the draft
    runner's, which afdc's worker would ignore, is refused naming it; vLLM's defaults pass."""
    from afdc.serve.speculative_config import refusal

    served = ({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "standard",
               "draft_tensor_parallel_size": 1},
              {"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": BY_BATCH_SIZE})
    assert [refusal(c, drafter="mtp") for c in served] == [None, None]
    for setting in ({"draft_sample_method": "probabilistic"}, {"rejection_sample_method": "synthetic"},
                    {"parallel_drafting": True}, {"draft_tensor_parallel_size": 2}, {"quantization": "fp8"},
                    {"kv_cache_dtype": "fp8"}):
        why = refusal({"method": "mtp", "num_speculative_tokens": 2, **setting}, drafter="mtp")
        name, value = next(iter(setting.items()))
        assert why is not None and f"{name}={value!r}" in why and "leave it out" in why, why
