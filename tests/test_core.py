"""The compiler core on small models built here: the split, the cut, the runtime, the errors."""

from __future__ import annotations

import functools
import json
import threading

import pytest
import torch
import torch.fx as fx
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM

import afdc
from afdc.cli import main
from afdc.demo import demo_batch, demo_model
from afdc.equivalence import check
from afdc.lowering.lm_head import split_head
from afdc.lowering.piecewise import pauses_after_piece, split_at_sends
from afdc.lowering.straight_line import straight_line
from afdc.ops import body_of
from afdc.ops.attention import attention_body
from afdc.partition.mincut import FlowGraph
from afdc.passes.graph_facts import op_name
from afdc.runtime import link as connectors
from afdc.runtime.metrics import CPU_SAMPLED, EXACT_USES, Phases
from afdc.runtime.model import positions_from_mask
from afdc.runtime.programs import combine
from afdc.segment import Dispatch, Share
from models_supported.catalog import ENTRIES, TINY_COMMON, build_type, entry, unavailable


@pytest.fixture(scope="module")
def moe():
    model = demo_model()
    return model, afdc.disaggregate(model)


def test_demo_model_matches_monolith(moe):
    model, dm = moe
    result = check(model, dm, *demo_batch(model.config.vocab_size))
    assert result.ok(), str(result)


def test_parameters_disjoint_and_covering(moe):
    model, dm = moe
    attn, ffn = set(dm.attention.parameter_names()), set(dm.ffn.parameter_names())
    assert not attn & ffn
    assert attn | ffn == {n for n, _ in model.named_parameters()}
    # the experts and routers live on the FFN side, norms and attention on the attention side
    assert all(".mlp." in n for n in ffn)
    assert not any(".mlp." in n for n in attn)


def test_pre_norm_cut_sends_normed_hidden_and_receives_ffn_output(moe):
    model, dm = moe
    h = model.config.hidden_size
    for layer in dm.report().layers:
        assert layer.kind == "moe" and layer.experts == 8 and layer.top_k == 2
        assert [c.shape_per_token for c in layer.to_ffn] == [[h]]
        assert [c.shape_per_token for c in layer.to_attn] == [[h]]
    assert dm.report().segment_graphs == 1  # identical layers share one FFN graph
    # layers are labelled by the model's own module paths (capture's wrapper leaves no trace)
    assert [layer.module for layer in dm.report().layers] == [f"model.layers.{i}" for i in range(4)]


def test_traffic_matches_report(moe):
    model, dm = moe
    ids, mask = demo_batch(model.config.vocab_size)
    dm(ids, attention_mask=mask)
    per_token = dm.report().bytes_to_ffn
    assert dm.last_traffic.to_ffn_bytes == per_token * ids.numel()
    assert dm.last_traffic.to_attn_bytes == dm.report().bytes_to_attn * ids.numel()


def test_in_process_ffn_runs_are_timed_where_asked(moe):
    """A served monolith's step is taken apart like a disaggregated one's: each FFN layer run in
    process is one use of phase ``ffn``, and timing it changes no output."""
    model, dm = moe
    ids, mask = demo_batch(model.config.vocab_size)
    untimed = dm(ids, attention_mask=mask).logits
    rank, phases = dm.ranks[0], Phases()
    rank.phases = phases
    try:
        timed = dm(ids, attention_mask=mask).logits
    finally:
        rank.phases = None
    assert torch.equal(timed, untimed)
    ffn = phases.to_dict()["ffn"]
    assert ffn["count"] == len(dm.ffn.layers) == model.config.num_hidden_layers
    assert ffn["seconds"] > 0 and ffn["cpu"] > 0


def test_per_message_phases_read_the_cpu_clock_on_a_sample():
    """A phase timed per message reads the CPU clock (a system call) on its first uses, then on
    about one in CPU_SAMPLED, and estimates the others' from those: every use counted, its wall
    time summed whole. Other phases read it every use."""
    phases = Phases()
    uses, reads = EXACT_USES + 800, 0
    for i in range(uses):
        read = phases.reads_cpu("send", per_message=True)
        assert read or i >= EXACT_USES
        reads += read
        phases.add("send", 0.002, 0.001 if read else None)
        assert phases.reads_cpu("step", per_message=False)
    assert 800 / CPU_SAMPLED / 2 < reads - EXACT_USES < 800 / CPU_SAMPLED * 2  # 100 expected: over 5 deviations apart
    send = phases.to_dict()["send"]
    assert send["count"] == uses and send["seconds"] == pytest.approx(0.002 * uses)
    assert send["cpu"] == pytest.approx(0.001 * uses)


def test_router_on_attention_side_sends_topk():
    model = demo_model()
    dm = afdc.disaggregate(model, router="attn")
    layer = dm.report().layers[0]
    shapes = sorted((c.dtype, c.shape_per_token) for c in layer.to_ffn)
    assert shapes == [("float32", [2]), ("float32", [64]), ("int64", [2])]
    assert not any("mlp.gate." in n for n in dm.ffn.parameter_names())
    assert check(model, dm, *demo_batch(model.config.vocab_size)).ok()


@pytest.mark.parametrize("router", ["ffn", "attn"])
def test_experts_that_mask_out_of_range_ids_are_split_over_ffn_ranks(router):
    """transformers 5.17 (and later versions under expert parallelism) zero the rows of expert ids
    past the last expert around each grouped matmul. Top-k ids never are: the masks go, and the
    experts split and cross the cut as without them (the top-k's ids and weights, no mask)."""
    model = demo_model()
    for layer in model.model.layers:
        layer.mlp.experts._is_expert_parallel = True  # the masks (always there in 5.17)
    dm = afdc.disaggregate(model, "1A2F", ffn_parallel="ep", router=router)
    for program in [dm.attention.module, *dm.ffn.segments]:
        assert not any(op_name(n).startswith(("masked_fill", "clamp")) for n in program.graph.nodes)
    if router == "attn":
        assert sorted(c.dtype for c in dm.report().layers[0].to_ffn) == ["float32", "float32", "int64"]
    assert check(model, dm, *demo_batch(model.config.vocab_size)).ok()


@pytest.mark.parametrize("model_type, overrides", [
    ("granitemoeshared", {"num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32}),
    ("aria_text", {"moe_num_experts": 4, "moe_topk": 2, "moe_num_shared_experts": 1}),
])
def test_a_hidden_state_and_its_reshape_cross_once(model_type, overrides):
    """Routers and experts that read the flattened hidden state while a shared expert reads it
    unflattened: under --router attn the hidden state crosses once, the FFN side redoes the
    flattening and the attention side keeps it as the router's input (GraniteMoE-shared flattens
    before the MoE block; Aria inside it, where the cut first moves it to the FFN side for its sizes)."""
    if why := unavailable(entry(model_type)):
        pytest.skip(why)
    model = build_type(model_type, {**TINY_COMMON, **overrides})
    dm = afdc.disaggregate(model, plan="1A2F", router="attn")
    hidden = TINY_COMMON["hidden_size"]
    for layer in dm.report().layers:
        assert [c.shape_per_token for c in layer.to_ffn if c.shape_per_token[-1] == hidden] == [[hidden]]
    ids = torch.randint(0, TINY_COMMON["vocab_size"], (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    assert check(model, dm, ids, mask).ok()


@pytest.mark.parametrize("model_type, overrides", [
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    ("gemma2", {"final_logit_softcapping": 5.0}),  # the head ends in a soft-capping: tanh(x / c) * c
])
def test_lm_head_runs_once_over_every_micro_batchs_rows(model_type, overrides):
    """Micro-batches run the program up to the LM head each, then the head once over all their
    rows (in decode the head's cost is reading its weight); the outputs stay the model's."""
    model = build_type(model_type, {**TINY_COMMON, **overrides})
    dm = afdc.disaggregate(model, micro_batches=2)
    split = split_head(dm.attention.module, dm.attention.out_spec)
    assert split is not None
    head_ops = [n.target for n in split.head.graph.nodes if n.op == "call_function"]
    assert (torch.ops.aten.tanh.default in head_ops) == ("final_logit_softcapping" in overrides)
    assert "lm_head.weight" not in dict(split.body.named_parameters())  # the body no longer reads it
    head = dm.attention._staged().head
    rows = []
    dm.attention._staged().head = lambda hidden: rows.append(hidden.shape[0]) or head(hidden)
    ids = torch.randint(0, TINY_COMMON["vocab_size"], (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left-padded
    assert check(model, dm, ids, mask).ok()
    # the call and generate's prefill: every token of all three rows, both micro-batches, at once
    assert rows[:2] == [3 * 7, 3 * 7]
    assert set(rows[2:]) == {3}  # decode: one token per row


def test_ffn_side_runs_only_through_the_connector(moe):
    """The attention program cannot run without a connector: no shortcut to the original model."""
    model, dm = moe
    ids, mask = demo_batch(model.config.vocab_size)
    with pytest.raises(RuntimeError, match="no active connector"):
        dm.attention(ids, mask, torch.arange(ids.shape[1]).expand_as(ids))


def test_eager_backend_runs_straight_line_code_written_from_the_graph(moe):
    """The same ops on the same values as the graph module, called without the Python around
    them: afdc's ops call their bodies, weights are bound. The program's graph keeps afdc's ops."""
    model, dm = moe
    ids, mask = demo_batch(model.config.vocab_size)
    pos = positions_from_mask(mask)
    with torch.no_grad():
        link = connectors.LoopbackConnector(functools.partial(combine, dm.ffn_ranks))
        with connectors.active(link):
            written = dm.attention(ids, mask, pos).logits  # the body's code, then the LM head's
            captured = dm.attention.module(ids, mask, pos)
    assert torch.equal(written, captured[0])
    code = dm.attention._staged().body._run.code
    assert "attention_body(" in code and "send_body(" in code and "recv_body(" in code
    assert "getattr" not in code  # no walks through the modules
    graph = dm.attention.module.graph
    assert code.count("aten_to_dtype(") < len(graph.find_nodes(op="call_function", target=torch.ops.aten.to.dtype))
    assert graph.find_nodes(op="call_function", target=torch.ops.afdc.attention.default)


def _stepped(run, link) -> tuple[object, int]:
    """What generator ``run`` returns, and how often it paused, each pause right after a send."""
    pauses = 0
    with connectors.active(link):
        while True:
            try:
                next(run)
            except StopIteration as stop:
                return stop.value, pauses
            pauses += 1
            assert len(link._pending) == 1  # paused right after a send, before its recv


def test_straight_line_pauses_after_each_send_in_its_generator_form(moe):
    """The generator form runs the same code, pausing once after each send to the FFN side (so one
    thread can interleave micro-batches) and returning what the function returns."""
    model, dm = moe
    ids, mask = demo_batch(model.config.vocab_size)
    pos = positions_from_mask(mask)
    body = dm.attention._staged().body
    ffn = functools.partial(combine, dm.ffn_ranks)
    with torch.no_grad():
        with connectors.active(connectors.LoopbackConnector(ffn)):
            whole = body(ids, mask, pos)
        link = connectors.LoopbackConnector(ffn)
        stepped, pauses = _stepped(dm.attention.body_steps(ids, mask, pos), link)
    assert pauses == len(dm.ffn.layers) == link.traffic.messages // 2
    assert all(torch.equal(a, b) for a, b in zip(whole, stepped, strict=True))
    # a program that sends nothing has no generator form
    graph = fx.Graph()
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (graph.placeholder("x"), 2)),))
    assert straight_line(fx.GraphModule(torch.nn.Module(), graph)).steps(torch.ones(2)) is None


def test_a_program_cut_at_its_sends_runs_piece_by_piece(moe):
    """The cut a compiled program gets (:mod:`afdc.lowering.piecewise`): one piece per FFN layer
    ending in its send, then the rest; each weight read inside the piece that uses it; run in
    turn by a parent that pauses after each send, the same outputs as the program."""
    model, dm = moe
    ids, mask = demo_batch(model.config.vocab_size)
    pos = positions_from_mask(mask)
    body = dm.attention._staged().body.module
    parent, pieces = split_at_sends(body)
    layers = len(dm.ffn.layers)
    assert [p.sends for p in pieces] == [True] * layers + [False]
    weights = {n.target for n in body.graph.find_nodes(op="get_attr")}
    assert {n.target for p in pieces for n in p.module.graph.find_nodes(op="get_attr")} == weights
    assert not parent.graph.find_nodes(op="get_attr")  # no weight crosses a cut
    ffn = functools.partial(combine, dm.ffn_ranks)
    with torch.no_grad():
        with connectors.active(connectors.LoopbackConnector(ffn)):
            whole = body(ids, mask, pos)
        link = connectors.LoopbackConnector(ffn)
        run = straight_line(parent, pause_after=pauses_after_piece).steps(ids, mask, pos)
        stepped, pauses = _stepped(run, link)
    assert pauses == layers
    assert all(torch.equal(a, b) for a, b in zip(whole, stepped, strict=True))
    assert split_at_sends(dm.attention._staged().head.module) is None  # nothing to cut


def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _thrice(x: torch.Tensor) -> torch.Tensor:
    return x * 3


_TWICE = torch.library.custom_op("afdc_test::twice", _twice, mutates_args=())
_THRICE = torch.library.custom_op("afdc_test::thrice", _thrice, mutates_args=())
_THRICE.register_kernel("cpu")(lambda x: x * 3)


def test_python_custom_ops_are_called_as_their_functions():
    """The eager code calls a Python custom op's own function where it is the op's kernel on every
    device (afdc's ops, transformers' grouped matmul); an op with a kernel of its own for some
    device goes through the dispatcher, which picks that kernel."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    twice = graph.call_function(torch.ops.afdc_test.twice.default, (x,))
    graph.output((graph.call_function(torch.ops.afdc_test.thrice.default, (twice,)),))
    line = straight_line(fx.GraphModule(torch.nn.Module(), graph))
    assert "_twice(x)" in line.code and "_thrice(" not in line.code
    assert torch.equal(line(torch.ones(2))[0], torch.full((2,), 6.0))
    assert body_of(torch.ops.afdc.attention.default) is attention_body
    assert body_of(torch.ops.aten.mul.Tensor) is None


def test_straight_line_reads_the_tensors_the_module_holds_now():
    """A parameter or buffer replaced after the code was written (``module.to()``, an assigning
    ``load_state_dict``) is what the code reads, as the module itself would."""
    owner = torch.nn.Module()
    owner.register_parameter("w", torch.nn.Parameter(torch.ones(2)))
    owner.register_buffer("b", torch.zeros(2))
    root = torch.nn.Module()
    root.add_module("sub", owner)
    graph = fx.Graph()
    x = graph.placeholder("x")
    w, b = graph.get_attr("sub.w"), graph.get_attr("sub.b")
    scaled = graph.call_function(torch.ops.aten.mul.Tensor, (x, w))
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (scaled, b)),))
    module = fx.GraphModule(root, graph)
    line = straight_line(module)
    assert torch.equal(line(torch.full((2,), 3.0))[0], torch.full((2,), 3.0))
    module.load_state_dict({"sub.w": torch.full((2,), 2.0), "sub.b": torch.ones(2)}, assign=True)
    assert torch.equal(line(torch.full((2,), 3.0))[0], torch.full((2,), 7.0))
    assert torch.equal(line(torch.full((2,), 3.0))[0], module(torch.full((2,), 3.0))[0])


def test_straight_line_leaves_out_a_cast_only_for_the_dtype_seen_at_capture():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2)
    cast = graph.call_function(torch.ops.aten.to.dtype, (x, torch.float32))
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (cast, 2)),))
    line = straight_line(fx.GraphModule(torch.nn.Module(), graph))
    assert "to_dtype" not in line.code
    assert torch.equal(line(torch.ones(2))[0], torch.full((2,), 2.0))
    # an input of another dtype runs the graph module, cast included
    assert line(torch.ones(2, dtype=torch.float64))[0].dtype == torch.float32


def test_loopback_connector_rejects_out_of_order_use():
    link = connectors.LoopbackConnector(lambda layer, xs: [x * 2 for x in xs])
    with pytest.raises(RuntimeError, match="before it was sent"):
        link.recv(0, 0, (2,), torch.float32)
    link.send(0, [torch.ones(2)])
    with pytest.raises(RuntimeError, match="sent twice"):
        link.send(0, [torch.ones(2)])
    assert torch.equal(link.recv(0, 0, (2,), torch.float32), torch.full((2,), 2.0))
    link.send(1, [torch.ones(2), torch.zeros(2)])
    for index in (-1, 2):  # -1 would read output 1 in its place
        with pytest.raises(RuntimeError, match=f"has 2 outputs; output {index} was asked for"):
            link.recv(1, index, (2,), torch.float32)


def _llama(**overrides):
    cfg = AutoConfig.for_model(
        "llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, **overrides,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_batch_of_one_and_single_token_prompt():
    model = _llama()
    dm = afdc.disaggregate(model)
    ids = torch.tensor([[5]])
    assert torch.allclose(model(ids).logits, dm(ids).logits, atol=1e-5)
    model.generation_config.eos_token_id = None
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), dm.generate(ids, max_new_tokens=6))


def test_bf16_model():
    model = _llama().to(torch.bfloat16)
    dm = afdc.disaggregate(model)
    ids = torch.randint(0, 128, (2, 6))
    assert dm.report().layers[0].to_ffn[0].dtype == "bfloat16"
    assert dm.report().layers[0].to_ffn[0].bytes_per_token == 64
    assert torch.allclose(model(ids).logits.float(), dm(ids).logits.float(), atol=2e-2)


def test_generate_stops_at_eos_and_pads_like_transformers():
    model = _llama()
    ids = torch.randint(1, 128, (2, 5))
    free = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = int(free[0, 6])  # the first row's second new token becomes its end
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = afdc.disaggregate(model).generate(ids, max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ref, out)


def test_plan_parsing():
    assert afdc.Plan.parse("2A2F") == afdc.Plan(2, 2)
    assert str(afdc.Plan.parse(" 4a1f ")) == "4A1F"
    for bad in ("2A", "A2F", "0A1F", "1A0F", "2F2A", "xAyF", ""):
        with pytest.raises(afdc.PlanError, match=r"xAyF|at least one"):
            afdc.Plan.parse(bad)


def test_a_dtype_is_a_name_or_a_torch_dtype_and_disaggregate_does_not_convert_silently():
    assert afdc.Plan.parse("1A1F", dtype=torch.bfloat16).dtype == "bf16"
    model = _llama()
    ids = torch.randint(1, 128, (1, 4))
    same = afdc.disaggregate(model, dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(same, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(afdc.PlanError, match=r"in the dtype it is in \(torch.float32\), not bf16: cast it first"):
        afdc.disaggregate(model, dtype="bf16")


def test_unknown_router_placement_and_connector_are_refused_at_once():
    with pytest.raises(ValueError, match="'gpu'"):
        afdc.disaggregate(_llama(), router="gpu")
    with pytest.raises(afdc.AfdcError, match="unknown connector 'shmm'; choose one of"):
        afdc.disaggregate(_llama(), connector="shmm")  # not only when launch() comes to use it


def test_pure_state_space_model_is_refused():
    cfg = AutoConfig.for_model("mamba", vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(afdc.UnsupportedModelError, match="no FFN region"):
        afdc.disaggregate(model)


def test_min_cut_takes_the_cheapest_edge_nearest_the_sink():
    g = FlowGraph()
    g.add_edge("s", "a", 4.0)
    g.add_edge("a", "b", 4.0)
    g.add_edge("b", "t", 9.0)
    assert g.max_flow("s", "t") == 4.0
    assert g.sink_side("t") == {"b", "t"}  # ties between s->a and a->b resolve toward the sink


def test_cli_inspect_demo_json():
    result = CliRunner().invoke(main, ["inspect", "--demo", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["equivalence"]["greedy_equal"] is True
    assert len(data["report"]["layers"]) == 4


def test_cli_inspect_needs_model_or_demo():
    result = CliRunner().invoke(main, ["inspect"])
    assert result.exit_code == 2 and "either MODEL or --demo" in result.output


def test_cli_inspect_bad_source(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "not_a_model"}))
    result = CliRunner().invoke(main, ["inspect", str(bad)])
    assert result.exit_code == 2 and "unknown model_type 'not_a_model'" in result.output


def test_cli_inspect_config_file_on_meta_device(tmp_path):
    """A config with no weights is split on the meta device, in the config's dtype."""
    cfg = AutoConfig.for_model(
        "deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, dtype="bfloat16",
    )
    cfg.save_pretrained(tmp_path)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    layers = json.loads(result.output)["layers"]
    assert [(lr["kind"], lr["experts"], lr["top_k"]) for lr in layers] == [
        ("dense", None, None), ("moe", 8, 2), ("moe", 8, 2)
    ]
    assert all(c["dtype"] == "bfloat16" and c["shape_per_token"] == [64] for lr in layers for c in lr["to_ffn"])


def test_arguments_that_change_the_result_are_refused(moe):
    model, dm = moe
    ids, mask = demo_batch(model.config.vocab_size)
    with pytest.raises(TypeError, match="inputs_embeds"):
        dm(ids, attention_mask=mask, inputs_embeds=torch.zeros(2, 12, 64))
    with pytest.raises(TypeError, match="output_hidden_states"):
        dm(ids, attention_mask=mask, output_hidden_states=True)
    with pytest.raises(TypeError, match=r"'labels'\] \(compute a loss from .logits\)"):
        dm(ids, attention_mask=mask, labels=ids)
    with pytest.raises(ValueError, match="must be \\[batch, tokens\\]"):
        dm(ids[None], attention_mask=mask[None])
    with pytest.raises(ValueError, match="beam_search"):  # what generate honours: tests/test_generation.py
        dm.generate(ids, attention_mask=mask, num_beams=2)
    # what asks for nothing more is accepted, as the model accepts it
    assert dm.eval() is dm and ids.to(dm.device).device == model.device
    out = dm(ids, attention_mask=mask, use_cache=False, return_dict=True, output_hidden_states=False, labels=None)
    assert out.logits.shape == (2, 12, 512)
    as_tuple = dm(ids, attention_mask=mask, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], out.logits)
    # sampling parameters are ignored under greedy decoding, as transformers' generate ignores them
    greedy = dm.generate(ids, attention_mask=mask, max_new_tokens=3)
    same = dm.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, temperature=0.3, top_p=0.5)
    assert torch.equal(greedy, same)


def test_rows_dispatch_shares_out_the_tokens():
    """A replicated layer's tokens go out in contiguous shares (none empty unless the message is)
    and come back in order; partial results are summed; replicated copies come from rank 0."""
    rows = Dispatch(("rows",), ([1, -1, 8],))
    assert rows.shares([], 7, 3) == (Share(0, 0, 2), Share(1, 2, 4), Share(2, 4, 7))
    assert rows.shares([], 2, 3) == (Share(1, 0, 1), Share(2, 1, 2))
    assert rows.shares([], 0, 3) == (Share(0, 0, 0),)
    x = torch.arange(56.0).reshape(1, 7, 8)
    shares = rows.shares([x], rows.tokens([x]), 3)
    parts = [rows.take([x], s, 7)[0] for s in shares]
    assert [tuple(p.shape) for p in parts] == [(1, 2, 8), (1, 2, 8), (1, 3, 8)]
    assert torch.equal(rows.combine(0, [p * 2 for p in parts], shares).reshape(1, 7, 8), x * 2)

    mixed = Dispatch(("sum", "first"), ([-1, 8],))
    shares = mixed.shares([], 7, 2)
    assert shares == (Share(0, 0, 7), Share(1, 0, 7))
    a, b = torch.ones(7, 8), torch.full((7, 8), 2.0)
    assert torch.equal(mixed.combine(0, [a, b], shares), a + b) and mixed.combine(1, [a, b], shares) is a
    assert Dispatch(("first",), ([-1, 8],)).shares([], 7, 2) == (Share(0, 0, 7),)


def test_a_length_bound_found_at_capture_is_enforced():
    """XGLM slices its sinusoidal table to the length: the strict export refuses, the relaxed one
    records the bound, and the disaggregated model refuses longer inputs instead of indexing
    past the table. (A bound far short of the model's context, a branch for short inputs only,
    is refused at capture: Qwen3-Next in the catalog's refusals.)"""
    model = build_type("xglm", {**TINY_COMMON, "d_model": 32, "ffn_dim": 64, "num_layers": 2, "attention_heads": 4})
    dm = afdc.disaggregate(model)
    assert dm.max_positions == model.config.max_position_embeddings == 128
    assert "valid for at most 128 positions" in str(dm.report())
    ids = torch.randint(3, 128, (1, 128))
    with torch.no_grad():
        torch.testing.assert_close(dm(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    with pytest.raises(afdc.AfdcError, match=r"129 positions .* exceed the 128"):
        dm(torch.randint(3, 128, (1, 129)))


def test_sparse_attention_indices_reach_the_attention_op():
    """DeepSeek-V3.2's indexer picks 4 keys per query. Its top-k ids are folded into the mask:
    the split model matches the sparse monolith, which differs from a dense one (so the match
    is not vacuous)."""
    overrides = {e.model_type: e for e in ENTRIES}["deepseek_v32"].config_kwargs
    sparse = build_type("deepseek_v32", overrides)
    dense = build_type("deepseek_v32", {**overrides, "index_topk": 64})
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, unsparse = sparse(ids).logits, dense(ids).logits
    assert (want - unsparse).abs().max() > 1e-3
    torch.testing.assert_close(afdc.disaggregate(sparse)(ids).logits, want, rtol=1e-4, atol=1e-5)


def test_hyper_connection_streams_stay_on_the_attention_side():
    """HY-V4 keeps 2 residual streams: each FFN reads a per-token mix of them, and its output is
    spread back over them. The cut sends the mixed [H] value and receives the FFN's [H] output,
    not the [2, H] streams (the small mixing weights stay with the streams). A batch of 3, where
    the capture's example had 2, checks that no pass pinned the batch size."""
    model = build_type("hy_v4", {e.model_type: e for e in ENTRIES}["hy_v4"].config_kwargs)
    dm = afdc.disaggregate(model, plan="1A2F")
    hidden = model.config.hidden_size
    for layer in dm.report().layers:
        assert [c.shape_per_token for c in layer.to_ffn] == [[hidden]], layer
        assert [c.shape_per_token for c in layer.to_attn] == [[hidden]], layer
    ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(dm(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)

    # Routed on the attention side, ids and weights cross too; the experts' projections stay on
    # the FFN side even where sending their [k, I] activations back would cost the same bytes.
    dm = afdc.disaggregate(model, plan="2A2F", router="attn")
    for layer in dm.report().layers:
        assert layer.to_ffn[0].shape_per_token == [hidden] and [c.shape_per_token for c in layer.to_attn] == [[hidden]]
    experts = {n for n, _ in model.named_parameters() if ".experts." in n}
    assert experts and experts <= set(dm.ffn.parameter_names())


def test_partial_sums_that_a_norm_reads_are_reduced_on_the_attention_side():
    """Gemma 4's MoE layer norms its dense MLP's output and its experts' output before adding
    them. One FFN rank returns the normed sum; over two (experts or rows split) the ranks hold
    partial sums that no norm may read, so the norms move to the attention side, which gets both
    reduced outputs back, even when its own router runs before them."""
    entry = {e.model_type: e for e in ENTRIES}["gemma4_text"]
    model = build_type("gemma4_text", entry.config_kwargs)
    hidden = model.config.hidden_size
    ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    for plan, kwargs, back in [("1A1F", {}, 1), ("1A2F", {"ffn_parallel": "tp"}, 2), ("2A2F", {"router": "attn"}, 2)]:
        dm = afdc.disaggregate(model, plan=plan, **kwargs)
        moe = [layer for layer in dm.report().layers if layer.kind == "moe"]
        assert moe and all(len(layer.to_attn) == back for layer in moe), (plan, kwargs, moe[0])
        assert all(c.shape_per_token == [hidden] for layer in moe for c in layer.to_attn)
        assert check(model, dm, ids, mask, new_tokens=4).ok(), (plan, kwargs)


def test_a_whole_value_gating_a_split_one_is_narrowed_per_rank():
    """Dense Gemma 4 multiplies each layer's split gate projection by a per-layer input that
    every FFN rank receives whole: each rank takes its share of it, and the gate splits. (With
    per-layer inputs half the width wide, that branch holds a square matrix's worth of weights and is
    an FFN region; Gemma 4's own, narrower, stay with attention.)"""
    overrides = {k: v for k, v in {e.model_type: e for e in ENTRIES}["gemma4_text"].config_kwargs.items()
                 if k not in ("enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size")}
    overrides["hidden_size_per_layer_input"] = TINY_COMMON["hidden_size"] // 2
    model = build_type("gemma4_text", overrides)
    dm = afdc.disaggregate(model, plan="2A2F")
    gates = [n for n in dm.ffn.parameter_names() if "per_layer_input_gate" in n]
    assert gates and all(ffn.parameters_of([n])[0].shape[0] * 2 == model.get_parameter(n).shape[0]
                         for ffn in dm.ffn_ranks for n in gates)
    ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    assert check(model, dm, ids, mask, new_tokens=4).ok()


def test_call_without_position_ids_follows_the_models_own_default():
    """Called without position_ids, Llama counts padding, OPT skips it, and RoBERTa counts from its
    pad token: each is reproduced (found by calling the model, so never assumed)."""
    from afdc.api import default_positions
    from afdc.runtime.model import DefaultPositions

    ids = torch.randint(3, TINY_COMMON["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    expected = {"llama": DefaultPositions.COUNT_PADDING, "opt": DefaultPositions.SKIP_PADDING}
    for model_type, rule in expected.items():
        model = build_type(model_type, TINY_COMMON)
        assert default_positions(model) is rule
        dm = afdc.disaggregate(model, "1A1F")
        assert torch.allclose(dm(ids, attention_mask=mask).logits[mask.bool()],
                              model(input_ids=ids, attention_mask=mask).logits[mask.bool()], atol=1e-5)
    roberta = build_type("roberta", {**TINY_COMMON, "is_decoder": True, "pad_token_id": 1})
    dm = afdc.disaggregate(roberta, "1A1F")
    assert dm.default_positions is DefaultPositions.FROM_PAD_TOKEN
    ids = ids.masked_fill(mask == 0, 1)
    with torch.no_grad():
        assert torch.allclose(dm(ids, attention_mask=mask).logits[mask.bool()],
                              roberta(input_ids=ids, attention_mask=mask).logits[mask.bool()], atol=1e-5)
    dm.default_positions = DefaultPositions.OWN  # a rule none of these reproduces is refused, not guessed
    with pytest.raises(afdc.AfdcError, match="pass position_ids"):
        dm(ids, attention_mask=mask)


def test_capture_state_is_per_attempt_and_per_thread():
    """What an export attempt traces lives in its own CaptureSession, current in this thread only
    (a model run in another thread meanwhile numbers no slot of it); a nested one restores the outer."""
    from afdc.capture import session

    outer, inner, elsewhere = session.CaptureSession(), session.CaptureSession(), []
    with session.tracing(outer):
        with session.tracing(inner):
            assert session.current() is inner
        assert session.current() is outer
        thread = threading.Thread(target=lambda: elsewhere.append(session.current()))
        thread.start()
        thread.join(timeout=10)
    assert elsewhere == [None] and session.current() is None


class _Guarded(torch.nn.Module):
    """A forward that branches on the token count: valid beyond ``longer_than``, or below ``shorter_than``."""

    def __init__(self, longer_than: int = 0, shorter_than: int = 1 << 30):
        super().__init__()
        self.longer_than, self.shorter_than = longer_than, shorter_than

    def forward(self, input_ids, attention_mask):
        if self.longer_than < input_ids.shape[1] < self.shorter_than:
            return input_ids * 2
        return input_ids


def test_a_relaxed_capture_is_valid_up_to_its_first_failing_guard():
    """A capture whose guards fail past 99 positions holds up to 99, and is refused where the
    model's context is longer; one whose guards fail already at 2 positions says so (not "up to
    None positions", as it once did)."""
    from afdc.capture.export import Specialized, relaxed_limit

    dims = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}

    def export(module):
        ids = torch.ones(2, 6, dtype=torch.long)
        return torch.export.export(module, (ids, torch.ones(2, 7, dtype=torch.long)),
                                   dynamic_shapes={"input_ids": dims, "attention_mask": dims}, strict=False)

    short = export(_Guarded(shorter_than=100))
    assert relaxed_limit(short, None) == relaxed_limit(short, 100) == 99
    with pytest.raises(Specialized, match="holds only up to 99 positions"):
        relaxed_limit(short, 4096)
    with pytest.raises(Specialized, match="fails its guards at 2 queries over 2 keys, the shortest lengths checked"):
        relaxed_limit(export(_Guarded(longer_than=4)), None)


def test_zaya_tokens_routed_to_the_skip_expert_get_no_expert_output():
    """ZAYA's router has one class more than its experts: a token that picks it (top-1) gets no
    expert's output. With the skip class unbiased (checkpoints bias it down) the tiny model's
    second layer sends some tokens there; the split model, its routing kept with attention since
    each router reads the previous layer's router state, still equals the monolith."""
    model = build_type("zaya", entry("zaya").config_kwargs)
    for layer in model.model.layers:
        layer.mlp.gate.balancing_biases[-1] = 0.0
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    skipped = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: skipped.append((out[1] == 0).float().mean()))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for hook in hooks:
        hook.remove()
    assert any(0 < share < 1 for share in skipped), skipped
    dm = afdc.disaggregate(model, plan="2A2F")
    assert [layer.kind for layer in dm.report().layers] == ["moe", "moe"]
    assert check(model, dm, ids, mask, new_tokens=4).ok()
