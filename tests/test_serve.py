"""Serving under vLLM with real servers: the official ``openai`` client against ``afdc up``.

Greedy completions and chat completions (streamed too) equal ``dm.generate`` of the same
artifact, for a dense and a MoE model under 1A1F and 2A2F; a small KV pool exercises prefix
caching and preemption; 200 requests with 32 in flight all complete; bad requests get a 400.
Each vLLM start costs 30-60 s of CI, so a deployment serves every check that can share it.
Skipped where vLLM is not installed (``pip install -e ".[serve]"``); CI installs it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # vLLM servers: run first (tests/conftest.py)

import afdc  # noqa: E402
from afdc.artifact.manifest import read_manifest  # noqa: E402
from afdc.cli import main  # noqa: E402
from afdc.compile import compile_model  # noqa: E402
from afdc.demo import demo_tokenizer, save_demo  # noqa: E402
from afdc.runtime.options import RuntimeOptions  # noqa: E402
from afdc.runtime.rendezvous import free_port  # noqa: E402
from afdc.serve.cores import PAIR_TOKENS, SETTLE_STEPS, Placement, parse_cpus, pin_thread, shared_core  # noqa: E402
from afdc.serve.settings import WorkerSettings  # noqa: E402
from afdc.serve.up import Deployment, wait_healthy  # noqa: E402
from models_supported.catalog import build, entry  # noqa: E402

NEW_TOKENS = 6
PROMPTS = [[5, 17, 99, 230], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 300], [42], [260, 261, 262, 263, 264, 265]]
STARTUP = 240.0
RECOVERY = 45.0  # the MoE deployment's --ffn-recovery-timeout: longer than an FFN rank's restart here


def _save_dense(directory: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    demo_tokenizer(config.vocab_size).save_pretrained(directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    _save_dense(root / "dense")
    save_demo(root / "moe")
    return root


def _artifact(models: Path, kind: str, plan: str, **options) -> Path:
    out = models / "-".join([kind, plan, *(f"{k}={v}" for k, v in sorted(options.items()))])
    if not out.exists():
        compile_model(str(models / kind), afdc.Plan.parse(plan, **options), out, progress=False)
    return out


def _reference(artifact: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy tokens of the same artifact run by afdc's own runtime (no eos: the requests ignore it)."""
    dm = afdc.load_deployment(artifact)
    out = []
    for p in prompts:  # one by one: no padding, as the server sees them
        ids = torch.tensor([p])
        out.append(dm.generate(ids, max_new_tokens=new_tokens, eos_token_id=[])[0, len(p):].tolist())
    return out


@contextlib.contextmanager
def _serving(artifact: Path, connector: str, tmp: Path, vllm_args: tuple[str, ...] = (), backend: str | None = None,
             recovery_timeout: float = 300.0):
    options = RuntimeOptions(connector=connector, rendezvous=f"127.0.0.1:{free_port()}", timeout=60)
    settings = WorkerSettings(str(artifact), options, backend=backend, recovery_timeout=recovery_timeout)
    # one API server in front of the DP engines (vLLM's default is one per DP rank): a cheaper start
    args = ("--max-model-len", "128", "--api-server-count", "1", *vllm_args)
    d = Deployment(artifact, settings, port=free_port(), vllm_args=args,
                   log_dir=tmp)
    try:
        url = d.start(STARTUP, print)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120), d
    finally:
        d.stop()


def _complete(client, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    model = client.models.list().data[0].id
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    return _token_ids(client, r.choices[0].logprobs.tokens)


def _token_ids(client, tokens: list[str]) -> list[int]:
    """Completion logprobs name tokens as ``token_id:N`` when asked (vLLM's return_tokens_as_token_ids)."""
    return [int(re.fullmatch(r"token_id:(\d+)", t).group(1)) for t in tokens]


def _check_completions_and_chat(client, artifact: Path) -> None:
    """Greedy completions (concurrent: they share vLLM batches) and a chat completion, plain and
    streamed, equal afdc's own greedy generation of the same artifact."""
    ref = _reference(artifact, PROMPTS)
    tokenizer = demo_tokenizer()
    chat = [{"role": "user", "content": "Hello, how are you today?"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(text, add_special_tokens=False).input_ids
    chat_ref = tokenizer.decode(_reference(artifact, [chat_ids])[0], skip_special_tokens=True)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _complete(client, p), PROMPTS * 2))
    assert got == ref * 2
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=chat, max_tokens=NEW_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True, "skip_special_tokens": True})
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        stream=True, **kwargs) if c.choices)
    assert text == streamed == chat_ref


def _check_data_parallel_ranks(log: Path, ranks: int) -> None:
    """One vLLM server ran every attention rank, each in the DP engine of its own rank."""
    text = log.read_text()
    for a in range(ranks):
        assert re.search(rf"EngineCore_DP{a} .*afdc: attention rank {a} of ", text), f"no DP engine {a} in {log}"


def _engine_counter(metrics: str, name: str) -> dict[str, float]:
    """A Prometheus counter of vLLM's /metrics text, per DP engine."""
    counts: dict[str, float] = {}
    for e, v in re.findall(rf'^{name}{{[^}}]*engine="(\d+)"[^}}]*}} (\S+)$', metrics, re.M):
        counts[e] = counts.get(e, 0.0) + float(v)  # summed over the other labels (finish reasons)
    return counts


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_quantized_checkpoint_served_equals_afdc_generate(models, tmp_path, monkeypatch, scheme):
    """A Qwen3-MoE-shaped checkpoint in fp8 blocks, or with its experts int4 pack-quantized
    (compressed-tensors, Kimi-K2-Thinking's format), compiled as shipped: the vLLM worker and the FFN
    rank processes, which load the quantized rank files, run the ops' torch references, as on a CPU
    host without the interpreter (the kernels in it are tests/test_kernels_quant.py's: here they took
    a third of the test's time)."""
    from quant_checkpoints import qwen3_moe_fp8, qwen3_moe_int4

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set by conftest on a CPU host only

    build = qwen3_moe_fp8 if scheme == "fp8" else qwen3_moe_int4
    ck = build(models / f"qwen3-{scheme}", vocab_size=512)
    demo_tokenizer(512).save_pretrained(ck.directory)
    config = json.loads((ck.directory / "config.json").read_text())  # the demo tokenizer's special tokens
    (ck.directory / "config.json").write_text(json.dumps({**config, "pad_token_id": 0, "bos_token_id": 1,
                                                          "eos_token_id": 2}))
    artifact = models / f"qwen3-{scheme}-1A2F"
    compile_model(str(ck.directory), "1A2F", artifact, progress=False)
    method = read_manifest(artifact).quant.method
    assert method == ("fp8" if scheme == "fp8" else "compressed-tensors")
    with _serving(artifact, "shm", tmp_path, ("--return-tokens-as-token-ids",)) as (client, _):
        assert [_complete(client, p) for p in PROMPTS] == _reference(artifact, PROMPTS)


def test_afdc_backend_and_expert_routing_under_vllm(models, tmp_path, monkeypatch):
    """The GPU default path on this CPU: every program lowered by the afdc backend (kernels in
    Triton's interpreter, Inductor for the rest) in the vLLM worker and the FFN servers, with the
    router on the attention side so each token goes only to its experts' FFN ranks; the tokens are
    those of the eager runtime. The worker compiles its programs for every step shape before it
    serves: no request's step (prefills, then decode steps of one token) recompiles."""
    monkeypatch.setenv("TORCH_LOGS", "recompiles")  # Dynamo logs each recompile, in every role's log
    artifact = _artifact(models, "moe", "1A2F", router="attn")
    assert read_manifest(artifact).segments[0].routing is not None
    with _serving(artifact, "shm", tmp_path, ("--return-tokens-as-token-ids",), backend="afdc") as (client, _):
        ref = _reference(artifact, PROMPTS[:2])
        assert [_complete(client, p) for p in PROMPTS[:2]] == ref
    log = (tmp_path / "attn.log").read_text()
    assert "micro-batches, backend afdc, FFN over shm" in log
    before, warmed, serving = log.partition("programs compiled for every step shape before serving")
    assert warmed and "Recompiling" in before and "Recompiling" not in serving
    for rank in range(2):  # each FFN server lowered its segment with afdc's fused MoE in it
        assert "FFN segment 0: {'fused_moe': 1} afdc kernels" in (tmp_path / f"ffn-{rank}.log").read_text()


# --sweep only: CI serves --attn-tp 2 on Qwen3-Next, its TP ranks over one paged store and its
# completions equal afdc's generation (test_serve_mixers.py, test_hybrid_preemption_keeps_outputs),
# and checks TP's tokens against the monolith's on this dense model in process (test_attention_tp.py)
@pytest.mark.sweep
def test_attention_tp_under_vllm(models, tmp_path):
    """--attn-tp 2 in the vLLM worker, its FFN rank a server over shared memory: two TP ranks
    (threads) over one paged store, each reading and writing its own heads; completions and chat
    equal afdc's own generation, and the tokens are the monolith's (the artifact without TP)."""
    artifact = _artifact(models, "dense", "1A1F", attention_tp=2)
    with _serving(artifact, "shm", tmp_path, ("--return-tokens-as-token-ids",)) as (client, _):
        _check_completions_and_chat(client, artifact)
    assert _reference(artifact, PROMPTS) == _reference(_artifact(models, "dense", "1A1F"), PROMPTS)
    assert "2 TP ranks" in (tmp_path / "attn.log").read_text()


@pytest.fixture(scope="module")
def moe_server(models, tmp_path_factory):
    """The MoE model under 2A2F over shared memory: its two attention ranks are the DP ranks of
    one vLLM server (one OpenAI port, vLLM's coordinator balancing). Shared by the tests below
    (the FFN-kill drill last: it leaves the deployment serving again)."""
    artifact = _artifact(models, "moe", "2A2F")
    args = ("--return-tokens-as-token-ids", "--max-num-seqs", "32")
    with _serving(artifact, "shm", tmp_path_factory.mktemp("moe-2a2f"), args, recovery_timeout=RECOVERY) as (client, d):
        yield artifact, client, d


def test_moe_2a2f_attention_ranks_are_vllm_dp_ranks(moe_server):
    """Both DP engines serve as attention ranks 0 and 1; 32 concurrent greedy requests equal
    afdc's own generation; each engine steps only for its own requests (no MoE lockstep: an idle
    rank makes no dummy steps, so its step count stays at what its requests needed)."""
    artifact, client, d = moe_server
    _check_data_parallel_ranks(d.log_dir / "attn.log", 2)
    _check_completions_and_chat(client, artifact)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
               for _ in range(32)]
    ref = _reference(artifact, prompts)
    url = str(client.base_url).removesuffix("/v1/")
    before = urllib.request.urlopen(f"{url}/metrics").read().decode()
    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(lambda p: _complete(client, p), prompts)) == ref
    metrics = urllib.request.urlopen(f"{url}/metrics").read().decode()
    served = _engine_counter(metrics, "vllm:request_success_total")
    assert sum(served.values()) - sum(_engine_counter(before, "vllm:request_success_total").values()) == 32
    assert set(served) == {"0", "1"} and min(served.values()) > 0, served  # the coordinator used both
    # then one request at a time: a step count per engine, idle or not, bounded by its own work
    steps = _engine_counter(metrics, "vllm:iteration_tokens_total_count")
    for p in prompts[:4]:
        _complete(client, p)
    after = urllib.request.urlopen(f"{url}/metrics").read().decode()
    grown = {e: n - steps[e] for e, n in _engine_counter(after, "vllm:iteration_tokens_total_count").items()}
    print(f"steps per DP engine for 4 sequential requests of {NEW_TOKENS} tokens: {grown}")
    assert sum(grown.values()) <= 4 * NEW_TOKENS, grown


def _documented_commands(heading: str, replace: dict[str, str]) -> list[list[str]]:
    """The ``afdc serve`` commands of the bash block after ``heading`` in docs/serving.md, with
    each ``replace`` key (a whole word) replaced, as argument lists for this Python."""
    import shlex

    docs = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    block = docs[docs.index(heading):].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        if line.startswith("afdc serve "):
            for old, new in replace.items():
                line = re.sub(rf"(?<![\w.:/-]){re.escape(old)}(?![\w.:/-])", new, line)
            commands.append([sys.executable, "-m", "afdc.cli", *shlex.split(line)[1:]])
    return commands


def test_two_attention_nodes_head_and_headless(models, tmp_path):
    """docs/serving.md's commands for two attention hosts, run on this machine with the dense model
    at 2A2F: a head (DP rank 0, the API, the store) and a headless process (DP rank 1) joined by
    vLLM's DP handshake, and two FFN ranks over gloo. Both engines serve as their attention ranks;
    concurrent greedy completions, and chat completions (streamed too), through the API equal
    afdc's own generation. (The MoE model at 2A2F over gloo: test_ray.py.)"""
    artifact = _artifact(models, "dense", "2A2F")
    api, store, rpc = free_port(), free_port(), free_port()
    commands = _documented_commands("Two attention hosts", {
        "out/m-2a2f": str(artifact), "10.0.0.1:29500": f"127.0.0.1:{store}", "10.0.0.1": "127.0.0.1",
        "0.0.0.0": "127.0.0.1", "8000": str(api), "13345": str(rpc), "cuda": "cpu", "cuda:0": "cpu", "cuda:1": "cpu",
    })
    assert [c[c.index("--role") + 1] for c in commands] == ["attn", "attn", "ffn", "ffn"], commands
    engine_args = ["--max-model-len", "128"]
    test_args = {"head": [*engine_args, "--api-server-count", "1", "--return-tokens-as-token-ids"],
                 "headless": engine_args}
    env = {**os.environ, "AFDC_TOKEN": "two-nodes-test-token"}
    names = ["head", "headless", "ffn-0", "ffn-1"]
    procs = {}
    try:
        for name, argv in zip(names, commands, strict=True):
            out = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
            procs[name] = subprocess.Popen(argv + test_args.get(name, []), env=env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{api}"
        wait_healthy(url, time.monotonic() + STARTUP, lambda: all(p.poll() is None for p in procs.values()))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120)
        prompts = PROMPTS * 4
        with ThreadPoolExecutor(16) as pool:
            assert list(pool.map(lambda p: _complete(client, p), prompts)) == _reference(artifact, prompts)
        _check_completions_and_chat(client, artifact)
        served = _engine_counter(urllib.request.urlopen(f"{url}/metrics").read().decode(), "vllm:request_success_total")
    finally:
        for p in procs.values():  # the API and its engines first: they finish their requests
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            with contextlib.suppress(ProcessLookupError):  # an engine left behind by a start that failed
                os.killpg(p.pid, signal.SIGKILL)
    assert served.keys() == {"0", "1"} and min(served.values()) > 0, served  # both engines served
    _check_data_parallel_ranks(tmp_path / "head.log", 1)
    headless = (tmp_path / "headless.log").read_text()
    assert re.search(r"EngineCore_DP1 .*afdc: attention rank 1 of .*FFN over gloo", headless), headless[-3000:]
    assert "attention rank 0" not in headless


# a KV pool of 10 blocks of 16 tokens, for at most 8 requests at once
PREFIX_CACHING = ("--enable-prefix-caching", "--block-size", "16", "--num-gpu-blocks-override", "10",
                  "--max-num-seqs", "8")


def _assert_prefix_caching_and_preemption(client, artifact: Path) -> None:
    """8 concurrent requests sharing a 32-token prefix, each growing past 48 tokens while decoding,
    on a server given PREFIX_CACHING: vLLM must reuse the cached prefix blocks and preempt requests
    to free blocks, and the outputs stay the same."""
    prefix = list(range(100, 132))
    prompts = [prefix + [200 + i] * (1 + i % 4) for i in range(8)]
    ref = _reference(artifact, prompts, 24)
    _complete(client, prompts[0], 24)  # fills the prefix blocks
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _complete(client, p, 24), prompts))
    metrics = urllib.request.urlopen(str(client.base_url).removesuffix("/v1/") + "/metrics").read().decode()
    assert got == ref
    assert _counter(metrics, "vllm:prefix_cache_hits_total") > 0
    assert _counter(metrics, "vllm:num_preemptions_total") > 0


def _counter(metrics: str, name: str) -> float:
    """A Prometheus counter of vLLM's /metrics text, summed over its labels."""
    return sum(float(m) for m in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", metrics, re.M))


def test_load_and_bad_requests(moe_server):
    _, client, _ = moe_server
    model = client.models.list().data[0].id
    g = torch.Generator().manual_seed(0)

    def one(i: int):
        prompt = torch.randint(3, 500, (int(torch.randint(1, 24, (1,), generator=g)),), generator=g).tolist()
        r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0.8, seed=i,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(200)))
    assert results == [("length", 4)] * 200

    # vLLM's structured output (grammar bitmask applied by the worker) and seeded sampling
    r = client.completions.create(model=model, prompt="Hello", max_tokens=12,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", r.choices[0].text), r.choices[0].text
    seeded = [client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=1.0, seed=7,
                                        extra_body={"ignore_eos": True}).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]

    with pytest.raises(openai.BadRequestError, match=r"maximum context length|max_model_len|longer than"):
        client.completions.create(model=model, prompt=[5] * 200, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=[5, 6], max_tokens=4, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client.completions.create(model=model, prompt=[5, 6], max_tokens=4, extra_body={"thinking_token_budget": 4})


def test_prompt_logprobs_of_every_prompt_token_under_2a2f(moe_server, models):
    """Prompt logprobs from both attention ranks, their steps split into micro-batches, while
    other requests decode beside them."""
    _, client, _ = moe_server
    _assert_prompt_logprobs(client, models / "moe", [PROMPTS[1], list(range(40, 90))])


def test_a_request_that_would_read_its_prompt_logprobs_from_the_prefix_cache_is_refused():
    """vLLM skips the prefix cache for a request with prompt logprobs; one that overrides it
    would get no logprobs for the cached positions, and is refused with the reason."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from afdc.serve.sampling import refuse_unsupported

    refuse_unsupported(SamplingParams(prompt_logprobs=3))
    with pytest.raises(VLLMValidationError, match="skip_reading_prefix_cache"):
        refuse_unsupported(SamplingParams(prompt_logprobs=3, skip_reading_prefix_cache=False))


def test_sampling_parameters_take_effect(moe_server):
    """vLLM's logits processors and masks, driven by the worker: each parameter changes the output
    the way it says."""
    _, client, _ = moe_server
    model = client.models.list().data[0].id
    prompt = [5, 17, 99, 230]

    def tokens(n: int = 8, **extra) -> tuple[list[int], str]:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=n, logprobs=0,
                                      temperature=extra.pop("temperature", 0), extra_body=extra)
        return _token_ids(client, r.choices[0].logprobs.tokens), r.choices[0].finish_reason

    greedy, _ = tokens(ignore_eos=True)
    assert tokens(ignore_eos=True, logit_bias={"77": 100}, temperature=1.0)[0] == [77] * 8
    assert set(tokens(ignore_eos=True, allowed_token_ids=[5, 6])[0]) <= {5, 6}
    assert tokens(ignore_eos=True, min_p=1.0, temperature=1.0)[0] == greedy  # only the top token survives
    out, reason = tokens(logit_bias={"77": 100}, stop_token_ids=[77], min_tokens=5)
    assert reason == "stop" and 77 not in out[:5] and len(out) <= 6
    first = demo_tokenizer().decode([greedy[0]])
    assert tokens(ignore_eos=True, bad_words=[first])[0][0] != greedy[0]


def _hf_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """The Hugging Face model's log-softmax at each position of ``prompt``, ``[len(prompt), vocab]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def _assert_prompt_logprobs(client, model_dir: Path, prompts: list[list[int]]) -> None:
    """``echo=True, logprobs=1`` (what lm-evaluation-harness's loglikelihood tasks send) returns
    every prompt token's logprob as the Hugging Face model of ``model_dir`` computes it, and its
    top token; ``prompt_logprobs=5`` (vLLM's parameter) the top 5 and the prompt token's own.
    The requests run concurrently with greedy decodes, so that steps mix both."""
    model = client.models.list().data[0].id

    def echoed(prompt: list[int]) -> tuple[list, list]:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
        lp = r.choices[0].logprobs
        assert _token_ids(client, lp.tokens[:len(prompt)]) == prompt
        return lp.token_logprobs[:len(prompt)], lp.top_logprobs[:len(prompt)]

    def top5(prompt: list[int]) -> list:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 5})
        return r.choices[0].model_extra["prompt_logprobs"]

    with ThreadPoolExecutor(8) as pool:
        decodes = [pool.submit(_complete, client, p) for p in PROMPTS]
        echoes = list(pool.map(echoed, prompts))
        tops = list(pool.map(top5, prompts))
        for d in decodes:
            d.result()
    for prompt, (logprobs, top), ranked in zip(prompts, echoes, tops):
        ref = _hf_logprobs(model_dir, prompt)[:-1]  # position i predicts token i + 1
        targets = torch.tensor(prompt[1:])
        assert logprobs[0] is None and top[0] is None and ranked[0] is None
        want = ref.gather(1, targets[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs[1:]), want, atol=2e-3), (logprobs[1:], want)
        best = [max(t, key=t.get) for t in top[1:]]
        assert _token_ids(client, best) == ref.argmax(-1).tolist()
        for i, position in enumerate(ranked[1:]):
            values, ids = ref[i].topk(5)
            got = {int(t): v["logprob"] for t, v in position.items() if v["rank"] <= 5}
            assert sorted(got) == sorted(ids.tolist())
            assert torch.allclose(torch.tensor([got[t] for t in ids.tolist()]), values, atol=2e-3)
            assert abs(position[str(prompt[i + 1])]["logprob"] - want[i].item()) < 2e-3


def test_drafts_are_verified_by_vllms_rejection_sampler_on_a_cpu():
    """Greedy verification as vLLM's kernel does it (here its torch twin, vLLM's Triton being off
    without a GPU): each request keeps its drafts up to the first the model disagrees with, then
    the model's own token; all agreeing, one more (the bonus); no drafts, the model's token.
    A step that also holds a sampling request verifies none: each samples at its last real token."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.sampler import Sampler

    from afdc.serve.sampling import SamplingRequest, sampling_metadata
    from afdc.serve.speculation import Verifier

    vocab, drafts = 16, [[3, 4], [], [7, 5], [6]]
    logits = torch.full((sum(len(d) + 1 for d in drafts), vocab), -5.0)
    for row, token in enumerate([3, 4, 9, 1, 2, 8, 5, 6, 11]):  # the model's argmax per row
        logits[row, token] = 5.0
    verifier = Verifier(Sampler())
    requests = [SamplingRequest(SamplingParams(temperature=0), [1], [], None) for _ in drafts]
    metadata = sampling_metadata(requests, vocab, torch.device("cpu"), LogitsProcessors())
    tokens, _ = verifier(logits, drafts, replace(metadata, spec_token_ids=drafts))
    assert tokens == [[3, 4, 9], [1], [2], [6, 11]]
    assert not verifier.verifies([SamplingParams(temperature=0), SamplingParams(temperature=1.0)])
    assert Verifier.unverified(logits, drafts).argmax(-1).tolist() == [3, 1, 2, 6]


def _until_ready(proc: subprocess.Popen, port: int) -> str:
    """``afdc up``'s output up to its ready line (or its exit), which must name the API at ``port``."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ready:") or proc.poll() is not None:
            break
    out = "".join(lines)
    assert f"ready: OpenAI API at http://127.0.0.1:{port}/v1" in out, out
    return out


def _until_running(url: str, timeout: float = 60.0) -> None:
    """Wait until vLLM's metrics show a request running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = urllib.request.urlopen(f"{url}/metrics").read().decode()
        if re.search(r"^vllm:num_requests_running\{[^}]*\} [1-9]", metrics, re.MULTILINE):
            return
        time.sleep(0.005)
    raise TimeoutError(f"no request started running within {timeout:g} s")


def _health(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_ffn_rank_lost_mid_request_and_back_in_time_loses_no_request(moe_server):
    """SIGKILL an FFN rank while requests decode: the attention ranks hold the step, /health
    answers 200 "degraded" naming the lost rank (a probe that reads the status sees a live
    server), and once the rank is restarted (within --ffn-recovery-timeout) every request
    completes with the tokens of afdc's own generation: none is lost."""
    artifact, client, d = moe_server
    n = 40
    ref = _reference(artifact, PROMPTS, n)
    client = client.with_options(max_retries=0)
    url = str(client.base_url).removesuffix("/v1/")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        requests = [pool.submit(_complete, client, p, n) for p in PROMPTS]
        _until_running(url)  # the requests decode: kill the FFN rank under them
        d.processes["ffn-0"].kill()
        lost = time.monotonic()
        deadline = lost + RECOVERY / 2
        while (health := _health(url))[0] == 200 and b"degraded" not in health[2] and time.monotonic() < deadline:
            time.sleep(0.1)
        status, headers, body = health
        assert status == 200 and headers.get("x-afdc-health") == "degraded", health
        assert json.loads(body)["status"] == "degraded" and "ffn rank 0" in json.loads(body)["problem"], body
        assert not any(r.done() for r in requests)  # held, not failed
        d.restart("ffn-0")
        got = [r.result(timeout=RECOVERY + 60) for r in requests]
    print(f"an FFN rank killed and restarted: requests held {time.monotonic() - lost:.1f} s")
    assert got == ref
    assert _health(url)[0:1] == (200,) and b"degraded" not in _health(url)[2]


def test_ffn_rank_lost_and_not_back_in_time_gets_a_503_after_the_recovery_timeout(moe_server):
    """SIGKILL the FFN rank while a request decodes and do not restart it: the request is held
    for --ffn-recovery-timeout, then ends with a 503 naming the lost rank, and /health is 503;
    once the rank is restarted, requests are served again."""
    artifact, client, d = moe_server
    ref = _reference(artifact, [PROMPTS[0]])[0]
    client = client.with_options(max_retries=0)
    model = client.models.list().data[0].id
    url = str(client.base_url).removesuffix("/v1/")
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(client.completions.create, model=model, prompt=PROMPTS[0], max_tokens=120,
                           temperature=0, extra_body={"ignore_eos": True})
        _until_running(url)  # the request decodes: kill the FFN rank under it
        d.processes["ffn-0"].kill()
        lost = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            long.result(timeout=RECOVERY + 60)
        held = time.monotonic() - lost
    print(f"an FFN rank killed and not restarted: the request failed after {held:.1f} s")
    assert failed.value.status_code == 503 and "ffn rank 0" in str(failed.value)
    assert RECOVERY <= held < RECOVERY + 5, held
    status, _, body = _health(url)  # whichever attention rank reported it
    assert status == 503 and b"ffn rank 0" in body, body
    d.restart("ffn-0")
    wait_healthy(url, time.monotonic() + STARTUP, lambda: True)
    assert _complete(client, PROMPTS[0]) == ref


# n-gram prompt lookup: up to 3 tokens that followed an earlier occurrence of the last 1-3 tokens
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def demo_up(tmp_path_factory):
    """`afdc up --demo` (the README's quick start): the served demo and where its files are. It
    must stop on SIGINT, every role with it."""
    tmp_path = tmp_path_factory.mktemp("demo-up")
    port = free_port()
    env = {**os.environ, "AFDC_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "afdc.cli", "up", "--demo", "--port", str(port), "--log-dir", str(tmp_path / "logs"),
         "--token-buckets", "16", "--attention-graphs", "4", "--", "--max-model-len", "128",
         "--return-tokens-as-token-ids", *PREFIX_CACHING,
         "--max-num-batched-tokens", "32", "--speculative-config", json.dumps(NGRAM)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    started = ""
    try:
        started = _until_ready(proc, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
        yield proc, client, started, tmp_path / "cache" / "demo"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, started + out
    assert "stopping every role" in out


def test_up_demo_serves_the_demo_model(demo_up):
    """The README's quick start: `afdc up --demo` builds, compiles and serves the demo model (MoE,
    1A1F, over shared memory), here with its FFN rank's batches padded to token buckets and its
    attention rank's decode steps padded to buckets of requests (up to 4; more run unpadded), which
    must not change a token, a small KV pool: prefix caching and preemption keep the outputs too, and a
    step budget of 32 tokens: prompt logprobs over a chunked prefill and after a cached prefix
    equal the Hugging Face model's; all under n-gram speculative decoding, which must not change
    a greedy token either, and whose drafts are verified and accepted."""
    proc, client, started, demo = demo_up
    artifact = demo / "afdc-demo"
    assert client.models.list().data[0].id == "afdc-demo"
    assert "decode steps padded to powers of two up to 4" in (demo.parents[1] / "logs" / "attn.log").read_text()
    assert _complete(client, PROMPTS[1]) == _reference(artifact, [PROMPTS[1]])[0]
    _assert_prefix_caching_and_preemption(client, artifact)
    prefix = list(range(300, 340))
    _complete(client, prefix)  # its blocks cached
    _assert_prompt_logprobs(client, demo / "model", [list(range(3, 73)), [*prefix, 11, 12]])
    url = str(client.base_url).removesuffix("/v1/")
    metrics = urllib.request.urlopen(f"{url}/metrics").read().decode()
    drafted, accepted = (_counter(metrics, f"vllm:spec_decode_num_{n}_tokens_total") for n in ("draft", "accepted"))
    print(f"n-gram speculation: {accepted:g} of {drafted:g} draft tokens accepted")
    assert drafted > 0 and accepted > 0
    _assert_placement(client, proc.pid, started)


LM_EVAL_TASK = """\
task: afdc_local_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _lm_eval_loglikelihoods(model: str, model_args: str, tasks: Path) -> list[float]:
    """lm-evaluation-harness's per-example loglikelihoods of the task in ``tasks``, by ``model``."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=["afdc_local_loglikelihood"],
                              task_manager=TaskManager(include_path=str(tasks)), log_samples=True, batch_size=4,
                              bootstrap_iters=0)
    samples = sorted(results["samples"]["afdc_local_loglikelihood"], key=lambda s: s["doc_id"])
    return [s["resps"][0][0][0] for s in samples]


def test_lm_eval_loglikelihoods_against_afdc_up_are_the_hf_models(demo_up, tmp_path, monkeypatch):
    """lm-evaluation-harness (`local-completions`, its OpenAI-completions client: `echo=True`,
    `logprobs=1`) runs a loglikelihood task over a local dataset file against `afdc up --demo`:
    each example's loglikelihood equals the `hf` backend's on the demo's Hugging Face model. No
    downloads: the task reads a local jsonl, and both tokenize with the demo's own tokenizer."""
    pytest.importorskip("lm_eval")  # afdc[eval]
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, client, _, demo = demo_up
    contexts = ["Attention and feed-forward layers", "The quick brown fox", "Mixture-of-experts models route each",
                "Hello world, how", "Experts out of many", "The lazy dog jumps"]
    continuations = [" run on separate pools", " jumps over the lazy dog.", " token to a few experts", " are you?",
                     " route tokens", " over the quick fox"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n"
                            for c, t in zip(contexts, continuations)))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "afdc_local.yaml").write_text(LM_EVAL_TASK.format(data=data))
    model_dir = demo / "model"
    served = _lm_eval_loglikelihoods(
        "local-completions", f"model=afdc-demo,base_url={client.base_url}completions,tokenizer={model_dir},"
        "tokenizer_backend=huggingface,max_retries=1", tmp_path / "tasks")
    hf = _lm_eval_loglikelihoods("hf", f"pretrained={model_dir},dtype=float32,device=cpu", tmp_path / "tasks")
    print("loglikelihoods: served", served, "hf", hf)
    assert len(served) == len(contexts)
    assert torch.allclose(torch.tensor(served), torch.tensor(hf), atol=2e-3), (served, hf)


def _assert_placement(client, pid: int, started: str) -> None:
    """``afdc up`` of 1A1F on a host of few cores puts the engine's step thread (vLLM runs steps on
    its engine core's main thread) and the FFN server's serving thread on one core while steps hold
    PAIR_TOKENS tokens or more, and lets them float again once steps are smaller; the API server is
    never placed. On a larger host nothing is."""
    import psutil

    core = shared_core(afdc.Plan.parse("1A1F"), 1, "cpu", disaggregated=True)
    tree = psutil.Process(pid).children(recursive=True)
    ffn = next(p for p in tree if "ffn" in p.cmdline() and "--role" in p.cmdline())
    engine = next(p for p in tree if "EngineCor" in p.name())
    api = next(p for p in tree if "serve" in p.cmdline() and "vllm.entrypoints.cli.main" in p.cmdline())
    every = os.sched_getaffinity(0)
    model = client.models.list().data[0].id

    def steps(streams: int, tokens: int) -> tuple[set[int], set[int]]:
        """Where both threads are after ``streams`` requests ran side by side (one prefill step,
        then ``tokens`` - 1 decode steps of ``streams`` tokens), each within one 16-token block."""
        r = client.completions.create(model=model, prompt=[[300 + i] for i in range(streams)], max_tokens=tokens,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert [c.finish_reason for c in r.choices] == ["length"] * streams
        return os.sched_getaffinity(ffn.pid), os.sched_getaffinity(engine.pid)

    # 8 streams (PREFIX_CACHING's most) of 14 tokens: 13 decode steps of 8 tokens, one stream: 11 of 1
    assert PAIR_TOKENS <= 8 and SETTLE_STEPS <= 13
    big, small = steps(8, 14), steps(1, SETTLE_STEPS + 4)
    assert os.sched_getaffinity(api.pid) == every
    if core is None:
        assert "share core" not in started
        assert big == small == (every, every)
    else:
        assert f"share core {core} while steps hold {PAIR_TOKENS} tokens or more" in started, started
        assert big == ({core}, {core}) and small == (every, every), (big, small)


def test_serve_refuses_bad_artifacts_and_ranks(models, tmp_path):
    def serve(*args):  # in-process: every case fails before `afdc serve` would become vLLM's server
        result = CliRunner().invoke(main, ["serve", *args])
        return result.exit_code, result.output

    code, out = serve(str(tmp_path / "nothing"), "--role", "attn", "--connector", "loopback")
    assert code == 2 and "is not a directory" in out
    artifact = _artifact(models, "dense", "1A1F")
    code, out = serve(str(artifact), "--role", "attn", "--rank", "1", "--rendezvous", "127.0.0.1:1")
    assert code == 2 and "attention ranks are vLLM's data-parallel ranks" in out
    code, out = serve(str(artifact), "--role", "attn")
    assert code == 2 and "--rendezvous" in out
    for cpus, said in [("1-0", "is not a range of cores"), ("x", "is not a core or a range"),
                       (str(max(os.sched_getaffinity(0)) + 1), "are not available to this process")]:
        code, out = serve(str(artifact), "--role", "ffn", "--rendezvous", "127.0.0.1:1", "--cpus", cpus)
        assert code == 2 and said in out, out
    code, out = serve(str(artifact), "--role", "ffn", "--rendezvous", "127.0.0.1:1", "--pin-tokens", "8")
    assert code == 2 and "give --cpus too" in out, out
    # attention ranks are vLLM's DP ranks: the plan's A and the DP arguments must agree
    two = str(_artifact(models, "dense", "2A2F"))
    code, out = serve(two, "--role", "attn", "--connector", "loopback", "--", "-dp", "3")
    assert code == 2 and "the plan has 2 attention ranks but vLLM was given --data-parallel-size 3" in out, out
    code, out = serve(two, "--role", "attn", "--connector", "loopback", "--", "--data-parallel-start-rank=2")
    assert code == 2 and "are not all within the plan's attention ranks 0..1" in out, out
    code, out = serve(two, "--role", "attn", "--connector", "loopback", "--", "--data-parallel-rank", "1")
    assert code == 2 and "external load balancing" in out, out
    # a further host's ranks (not rank 0, which hosts the store) reach the store before vLLM starts
    code, out = serve(two, "--role", "attn", "--rendezvous", f"127.0.0.1:{free_port()}", "--join-timeout", "2",
                      "--", "-dpl", "1", "-dpr", "1", "--headless")
    assert code == 2 and "cannot reach the rendezvous store" in out
    # afdc up --ray places ranks on any node of a Ray cluster: a one-host transport is refused first
    result = CliRunner().invoke(main, ["up", two, "--ray", "--connector", "shm"])
    assert result.exit_code == 2 and "--connector shm cannot join ranks on different nodes" in result.output
    result = CliRunner().invoke(main, ["up", two, "--ray", "--pin"])
    assert result.exit_code == 2 and "--pin shares a core of this host" in result.output
    plan_only = tmp_path / "plan-only"
    compile_model(str(models / "dense" / "config.json"), "1A1F", plan_only, weights=False, progress=False)
    code, out = serve(str(plan_only), "--role", "attn", "--connector", "loopback")
    assert code == 2 and "no model config and tokenizer" in out
    # a model saved without its tokenizer: said before vLLM starts, unless it is told to serve token ids
    build(entry("llama")).save_pretrained(tmp_path / "bare")
    compile_model(str(tmp_path / "bare"), "1A1F", tmp_path / "bare-1a1f", progress=False)
    code, out = serve(str(tmp_path / "bare-1a1f"), "--role", "attn", "--connector", "loopback")
    assert code == 2 and "the artifact has no tokenizer" in out and "--skip-tokenizer-init" in out, out
    # attention hard-coded inline (MPT): no KV cache to page, refused before vLLM starts, saying why
    build(entry("mpt")).save_pretrained(tmp_path / "mpt")
    compile_model(str(tmp_path / "mpt"), "1A1F", tmp_path / "mpt-1a1f", progress=False)
    code, out = serve(str(tmp_path / "mpt-1a1f"), "--role", "attn", "--connector", "loopback")
    assert code == 2 and "decode recomputes the prefix (token mixers run inline" in out, out
    # speculative decoding afdc cannot run (a drafter that is not in the artifact): refused before vLLM starts
    for config, said in [('{"method": "eagle3", "model": "x", "num_speculative_tokens": 2}', "EAGLE-3 heads"),
                         ('{"model": "some/draft", "num_speculative_tokens": 2}', "a separate draft model"),
                         ('{"method": "deepseek_mtp", "num_speculative_tokens": 1}', "multi-token-prediction layers"),
                         ("{not json", "is not JSON")]:
        code, out = serve(str(artifact), "--role", "attn", "--connector", "loopback", "--", "-sc", config)
        assert code == 2 and said in out and ("ngram" in out or "JSON" in said), out


def test_settings_round_trip_through_the_environment(monkeypatch):
    options = RuntimeOptions(connector="shm", rendezvous="h:1", spin=0.0, wait="cores", spin_cap=5e-3)
    s = WorkerSettings("/a", options, micro_batches=2, cpus=(1,))
    for k, v in s.to_env().items():
        monkeypatch.setenv(k, v)
    assert WorkerSettings.from_env() == s


SHM = RuntimeOptions(connector="shm", rendezvous="h:1")


def test_afdc_up_shares_a_cpu_hosts_cores_among_the_processes_that_compute():
    """Each attention engine and FFN server gets (cores - 1) // processes torch threads, at least
    one (one core for vLLM's API server and the clients); on a GPU torch's default stands; the
    FFN ranks' command line carries the threads, the wait policy and the metrics interval."""
    from afdc.serve.up import ffn_command, threads_per_role

    shm, mono = WorkerSettings("/a", SHM), WorkerSettings("/a", RuntimeOptions(connector="loopback"))
    assert threads_per_role(afdc.Plan.parse("1A1F"), shm, cores=2) == 1
    assert threads_per_role(afdc.Plan.parse("1A1F"), mono, cores=2) == 1
    assert threads_per_role(afdc.Plan.parse("1A1F"), mono, cores=16) == 15
    assert threads_per_role(afdc.Plan.parse("1A1F"), shm, cores=16) == 7
    assert threads_per_role(afdc.Plan.parse("2A2F"), shm, cores=16) == 3
    assert threads_per_role(afdc.Plan.parse("4A4F"), shm, cores=4) == 1
    assert threads_per_role(afdc.Plan.parse("1A1F"), WorkerSettings("/a", device="cuda:0"), cores=16) is None
    argv = ffn_command(WorkerSettings("/a", replace(SHM, spin=0.0, log_interval=5), threads=3), 0)
    assert argv[argv.index("--threads") + 1] == "3" and argv[argv.index("--spin") + 1] == "0.0"
    assert argv[argv.index("--log-interval") + 1] == "5"
    assert "--spin" not in ffn_command(shm, 0) and "--threads" not in ffn_command(shm, 0)
    argv = ffn_command(WorkerSettings("/a", replace(SHM, wait="cores", spin_cap=0.002, yield_late=0.0)), 0)
    assert argv[argv.index("--wait") + 1] == "cores" and argv[argv.index("--spin-cap") + 1] == "0.002"
    assert argv[argv.index("--yield-late") + 1] == "0.0"
    assert "--cpus" not in ffn_command(shm, 0)
    argv = ffn_command(WorkerSettings("/a", SHM, cpus=(1, 3)), 0)
    assert argv[argv.index("--cpus") + 1] == "1,3" and "--pin-tokens" not in argv
    argv = ffn_command(WorkerSettings("/a", SHM, cpus=(1,), pin_tokens=8), 0)
    assert argv[argv.index("--cpus") + 1] == "1" and argv[argv.index("--pin-tokens") + 1] == "8"


def test_afdc_up_puts_a_1a1f_pair_that_takes_turns_on_one_core_of_a_small_host():
    """1A1F with one micro-batch on a CPU host of under 4 cores shares the last core; more cores, more
    micro-batches, more ranks, a GPU or a monolith float; --pin asks for it anywhere a pair exists,
    --no-pin never."""
    one, two = afdc.Plan.parse("1A1F"), afdc.Plan.parse("2A2F")
    assert shared_core(one, 1, "cpu", True, cores=[0, 1]) == 1
    assert shared_core(one, 1, "cpu", True, cores=[2, 5, 7]) == 7
    for plan, micro_batches, device, disaggregated, cores in [
        (one, 1, "cpu", True, range(4)), (one, 2, "cpu", True, [0, 1]), (two, 1, "cpu", True, [0, 1]),
        (one, 1, "cuda:0", True, [0, 1]), (one, 1, "cpu", False, [0, 1]),
    ]:
        assert shared_core(plan, micro_batches, device, disaggregated, cores=cores) is None
    assert shared_core(one, 2, "cuda", True, pin=True, cores=range(16)) == 15
    assert shared_core(one, 1, "cpu", True, pin=False, cores=[0, 1]) is None
    with pytest.raises(afdc.AfdcError, match="this deployment is 2A2F"):
        shared_core(two, 1, "cpu", True, pin=True)
    with pytest.raises(afdc.AfdcError, match="this deployment is monolithic"):
        shared_core(one, 1, "cpu", False, pin=True)
    assert parse_cpus("3,0-1, 1") == (0, 1, 3)
    every, seen = os.sched_getaffinity(0), []

    def pinned() -> None:  # in a thread of its own: pinning applies to the calling thread
        pin_thread([min(every)])
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    assert seen == [{min(every)}] and os.sched_getaffinity(0) == every


def test_a_pair_shares_its_core_while_steps_are_big_and_floats_while_they_are_small():
    """A thread placed by step size moves to the shared core after SETTLE_STEPS steps in a row of
    PAIR_TOKENS tokens or more, and back to its own cores after as many smaller ones; a lone big
    step (a prefill) or small one (a batch's tail) moves nothing. ``from_tokens`` 0 moves it at
    its first step for good. Real affinities, each placement in a thread of its own."""
    every = os.sched_getaffinity(0)
    if len(every) < 2:
        pytest.skip("needs a process that may run on two cores")
    shared = {max(every)}

    def placed(from_tokens: int, sizes: list[int]) -> list[set[int]]:
        where: list[set[int]] = []

        def run() -> None:
            placement = Placement(shared, from_tokens)
            for tokens in sizes:
                placement.step(tokens)
                where.append(os.sched_getaffinity(0))

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return where

    big, small, n = PAIR_TOKENS, PAIR_TOKENS - 1, SETTLE_STEPS
    where = placed(PAIR_TOKENS, [1, 32, 1] + [big] * n + [small] + [big] * 3 + [small] * n + [64])
    assert where[: 2 + n] == [every] * (2 + n)  # a prefill between small steps moves nothing
    assert where[2 + n : 2 * n + 6] == [shared] * (n + 4)  # the n-th big step in a row moves it
    assert where[2 * n + 6 :] == [every] * 2  # then n small ones move it back; one big step does not
    assert placed(0, [1, 1, 500]) == [shared] * 3
    assert os.sched_getaffinity(0) == every


def test_a_placement_the_host_refuses_leaves_the_thread_where_it_is(caplog):
    """A move the kernel refuses (here: a core that is not online, as after a cpuset shrank under
    the process) is said once as a warning; the thread stays where it was and serving goes on."""
    every, where = os.sched_getaffinity(0), []

    def run() -> None:
        placement = Placement([min(every)], 0, "attention rank 0")
        placement.cpus = (os.cpu_count() + 64,)  # what a shrunken cpuset leaves: no core it may use
        for tokens in (16, 16):
            placement.step(tokens)
            where.append(os.sched_getaffinity(0))

    with caplog.at_level(logging.INFO, logger="afdc.cores"):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert where == [every, every]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "attention rank 0 cannot move to cores" in warned[0].getMessage()


def test_ctrl_c_while_the_ffn_rank_waits_for_the_store_stops_every_role_promptly(models, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) while `afdc up`'s FFN rank waits for the
    store, which the attention rank hosts once its vLLM engine is up: every process is gone
    within a few seconds, and `afdc up` says the stop was asked for (before, the FFN rank sat
    in c10d's connect retry for about 40 s, and `afdc up` reported that the server exited before
    it became healthy)."""
    import psutil

    artifact = _artifact(models, "moe", "1A1F")
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "afdc.cli", "up", str(artifact), "--port", str(free_port()), "--log-dir", str(logs),
         "--stop-timeout", "5", "--", "--max-model-len", "128"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + STARTUP
        while "reaching the rendezvous store" not in _read(logs / "ffn-0.log") and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        time.sleep(1.0)  # in the wait
        roles = psutil.Process(proc.pid).children(recursive=True)
        asked = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - asked
        psutil.wait_procs(roles, timeout=5)
        alive = [p for p in roles if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"afdc up stopped {took:.1f} s after SIGINT")
    assert "ready:" not in out, out  # the stop came while starting
    assert "stopping every role (asked for by SIGINT)" in out and "exited before it became healthy" not in out, out
    assert proc.returncode == 0, out
    assert not alive, alive
    assert took < 10, took
    assert "ffn rank 0: stopped (asked for by SIGINT)" in _read(logs / "ffn-0.log")


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_soak_under_faults_loses_no_request(models, tmp_path):
    """benchmarks/soak_faults.py, shortened: `afdc up` of the MoE model at 2A2F with one hot spare
    serves 24 requests, 8 in flight, while the process serving FFN rank 0 is SIGKILLed, then the
    one serving rank 1, then the spare that claims rank 1 while it loads: every request completes
    with the tokens of dm.generate, none errors, and the processes that served through the run
    kept their open file descriptors and about their resident memory."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from soak_faults import soak

    s = soak(_artifact(models, "moe", "2A2F"), tmp_path / "logs", requests=24, concurrency=8, tokens=8, kills=3)
    print(f"soak: p50 {s.faulted.percentile(50):.2f} s, p99 {s.faulted.percentile(99):.2f} s with faults "
          f"(clean {s.clean.percentile(50):.2f} s, {s.clean.percentile(99):.2f} s); takeovers {s.takeovers}; "
          f"kills {s.kills}")
    for run in (s.clean, s.faulted):
        assert not run.errors and not run.mismatches, (run.errors, run.mismatches)
        assert len(run.latencies) == 24
    assert len(s.kills) == 3, s.kills
    served = {name: r for name, r in s.resources.items() if not name.endswith("spare")}  # a spare's grow as it serves
    assert len(served) >= 4, s.resources  # afdc up, the API server, the engines, an FFN server at least
    for name, (rss, fds, rss_after, fds_after) in served.items():
        assert fds_after <= fds + 8, f"{name}: {fds} -> {fds_after} open files"
        assert rss_after <= 1.25 * rss + (64 << 20), f"{name}: RSS {rss >> 20} -> {rss_after >> 20} MiB"
