"""Launch failures said at once, with real processes and a real TCPStore: a launched FFN server
that dies before it joins is reported when it dies, with what it printed (a script without the
main guard is told to add it); a rank the store's host refuses (another token or artifact, its slot
held by a live process) exits with the reason instead of waiting; strangers cannot make members leave.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

import afdc
from afdc.artifact.load import deployment_of
from afdc.runtime.rendezvous import (
    JoinError,
    Layout,
    Member,
    PeerLost,
    Rendezvous,
    RendezvousError,
    free_port,
    parse_address,
)

JOIN_TIMEOUT = 60.0  # what a launch failure used to cost; every test here hears it far sooner

def _tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """A compiled 1A1F tiny llama."""
    root = tmp_path_factory.mktemp("art")
    _tiny_llama().save_pretrained(root / "src")
    afdc.compile_model(str(root / "src"), "1A1F", root / "art", progress=False)
    return root / "art"


def _serve(artifact, address: str, token: str) -> tuple[subprocess.CompletedProcess, float]:
    """``afdc serve ARTIFACT --role ffn`` to its end (a refused one ends by itself), and its seconds."""
    cmd = [sys.executable, "-m", "afdc.cli", "serve", str(artifact), "--role", "ffn", "--rank", "0",
           "--rendezvous", address, "--token", token, "--join-timeout", str(JOIN_TIMEOUT)]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * JOIN_TIMEOUT)
    return done, time.monotonic() - started


def test_script_without_the_main_guard_is_told_at_once(artifact, tmp_path):
    """The spawned server runs the script again and dies at its ``dm.launch()``: the launching
    process hears it when it dies, with the server's exit code and last lines, which name the guard.
    (The script loads the module's compiled tiny llama, a DisaggregatedModel as afdc.disaggregate's
    is, so that neither process spends a capture before the launch.)"""
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        import torch
        import afdc

        dm = afdc.load_deployment({str(artifact)!r})
        started = time.monotonic()
        try:
            with dm.launch(join_timeout={JOIN_TIMEOUT}):
                dm.generate(torch.randint(3, 128, (1, 5)), max_new_tokens=2)
        finally:  # the server, running this again, dies at dm.launch() before it gets here
            if __name__ == "__main__":
                print(f"elapsed {{time.monotonic() - started:.2f}}", file=sys.stderr)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=2 * JOIN_TIMEOUT)
    assert done.returncode == 1, done.stderr
    elapsed = float(re.search(r"elapsed ([\d.]+)", done.stderr).group(1))
    assert elapsed < JOIN_TIMEOUT / 2, done.stderr  # heard when it died, not at the join timeout (a loaded
    # host takes 20 s and more to start the server that dies)
    error = done.stderr[done.stderr.index("JoinError: "):]
    assert re.match(r"JoinError: ffn rank 0 cannot join: its server process \(pid \d+\) exited with code 1", error)
    assert 'the script must launch under `if __name__ == "__main__":`' in error
    assert "did not join" not in done.stderr


def test_launched_server_killed_before_it_joins_is_reported_then_restarts(artifact):
    dm = afdc.load_deployment(artifact)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    ref = dm.generate(ids, max_new_tokens=3, pad_token_id=0)  # in-process
    with dm.launch(join_timeout=JOIN_TIMEOUT) as cluster:
        cluster.kill(0)
        started = time.monotonic()
        with pytest.raises(JoinError, match=r"ffn rank 0 cannot join: its server process \(pid \d+\) was killed by "
                                            r"SIGKILL") as err:
            dm.generate(ids, max_new_tokens=3, pad_token_id=0)
        assert time.monotonic() - started < 20
        assert (err.value.role, err.value.rank) == ("ffn", 0)
        cluster.start(0)  # forgets the exit: the attention side joins the new process
        assert torch.equal(dm.generate(ids, max_new_tokens=3, pad_token_id=0), ref)


@pytest.mark.parametrize(
    ("token", "other_artifact", "reason"),
    [("wrong", False, "refused: wrong deployment token"), ("right", True, "refused: another artifact or plan")],
)
def test_refused_ffn_server_exits_with_the_reason(artifact, token, other_artifact, reason):
    """A mistyped token, or the store of another artifact's deployment: the server exits non-zero,
    saying why, as soon as it reaches the store, and without making the members regroup."""
    layout, deployment = deployment_of(artifact)
    address = f"127.0.0.1:{free_port()}"
    host = Rendezvous(address, layout, b"\x07" * 8 if other_artifact else deployment, "right", host=True)
    done, elapsed = _serve(artifact, address, token)
    assert done.returncode == 2, done.stderr
    assert f"error: ffn rank 0 {reason}" in done.stderr
    assert elapsed < 20  # its start-up; the refusal itself comes at once
    assert host.generation() == 0  # it never bumped the generation


def test_second_server_for_a_held_slot_is_refused(artifact):
    """``afdc serve`` for a rank whose server is live on this host exits saying so; the deployment
    keeps serving (it regroups once, at the newcomer's start)."""
    dm = afdc.load_deployment(artifact)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ref = dm.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)  # in-process
    with dm.launch(token="t", join_timeout=JOIN_TIMEOUT) as cluster:
        assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0), ref)
        done, elapsed = _serve(artifact, cluster.options.rendezvous, "t")
        assert done.returncode == 2, done.stderr
        pid = cluster.processes[0].pid
        assert f"error: ffn rank 0 refused: its slot is held by a live process (pid {pid} on " in done.stderr
        assert elapsed < 20
        assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0), ref)


def test_refusal_ends_even_a_wait_without_deadline(caplog):
    """Joining as a server does (no deadline), a process of another token or artifact raises at
    once; the members still see its hello and log the refusal."""
    layout, dep = Layout(1, 1), b"\x01" * 8
    address = f"127.0.0.1:{free_port()}"
    host = Rendezvous(address, layout, dep, "right", host=True)
    for intruder, reason in [
        (Rendezvous(address, layout, dep, "wrong"), "wrong deployment token"),
        (Rendezvous(address, layout, b"\x02" * 8, "right"), "another artifact or plan"),
    ]:
        with pytest.raises(JoinError, match=f"ffn rank 0 refused: {reason}"):
            intruder.check_slot(1)  # what a server asks before it bumps the generation
        started = time.monotonic()
        with pytest.raises(JoinError, match=f"ffn rank 0 refused: {reason}"):
            intruder.join(1, timeout=None, stop=threading.Event())
        assert time.monotonic() - started < 5
        with pytest.raises(PeerLost, match="ffn rank 0 lost: did not join"):
            host.join(0, timeout=0.5)
        assert "refused ffn rank 0" in caplog.text
        caplog.clear()


def test_exit_record_is_about_its_process():
    """A recorded exit ends a wait for the slot at once, also where the process had posted its hello
    before it died; a process that replaced it is not taken for it, and a wait without deadline
    (an FFN server's) does not read it."""
    layout, dep = Layout(1, 1), b"\x01" * 8
    address = f"127.0.0.1:{free_port()}"
    host = Rendezvous(address, layout, dep, "t", host=True)
    attn = Rendezvous(address, layout, dep, "t")
    gen = host.generation()
    dead = Member(1, 999_999, "elsewhere", "", host.proof(gen, 1))
    host.store.set(f"g{gen}/hello/1", json.dumps(asdict(dead)))
    host.record_exit(1, dead.pid, "its server process (pid 999999) was killed by SIGKILL")
    started = time.monotonic()
    with pytest.raises(JoinError, match=r"ffn rank 0 cannot join: its server process \(pid 999999\) was killed"):
        attn.join(0, timeout=JOIN_TIMEOUT)
    assert time.monotonic() - started < 5
    host.record_exit(1, 4242, "its server process (pid 4242) exited with code 1")  # another process exited
    assert set(attn.join(0, timeout=JOIN_TIMEOUT).members) == {0, 1}
    host.store.delete_key(f"g{gen}/hello/0")
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    assert Rendezvous(address, layout, dep, "t").join(1, timeout=None, stop=stop) is None  # kept waiting


def test_strangers_cannot_make_members_leave():
    """What a stranger writes into the store, an exit record without the token's proof or a new
    host stamp once the members checked theirs, changes nothing for them."""
    layout, dep = Layout(1, 1), b"\x01" * 8
    address = f"127.0.0.1:{free_port()}"
    host = Rendezvous(address, layout, dep, "right", host=True)  # noqa: F841 (the store lives with it)
    attn, ffn = (Rendezvous(address, layout, dep, "right") for _ in range(2))
    stranger = dist.TCPStore(*parse_address(address), is_master=False)
    stranger.set("exited/1", json.dumps({"pid": 1, "reason": "forged", "proof": "0" * 64}))
    with pytest.raises(PeerLost, match="ffn rank 0 lost: did not join"):  # the forged exit is not believed
        attn.join(0, timeout=0.5)

    def serve(stop: threading.Event) -> None:  # as a server does: join, then follow the generation
        while not stop.is_set() and (group := ffn.join(1, timeout=None, stop=stop)) is not None:
            while ffn.generation() == group.generation and not stop.is_set():
                time.sleep(0.01)

    stop = threading.Event()
    server = threading.Thread(target=serve, args=(stop,), daemon=True)
    server.start()
    try:
        first = attn.join(0, timeout=10)
        stranger.set("host", json.dumps({"deployment": "00" * 8, "proof": "0" * 64}))
        attn.bump()
        second = attn.join(0, timeout=10)
        assert second.generation > first.generation and set(second.members) == {0, 1}
    finally:
        stop.set()
        server.join(10)


def test_a_deployment_without_a_token_is_refused_unless_said_insecure(artifact, monkeypatch):
    """Without --token or $AFDC_TOKEN, anyone reaching the store could join and send the servers
    what it likes: `afdc serve --role ffn` exits at once naming the flag that allows it, and so
    does a rendezvous; with --insecure-no-token the server goes on (here to a store that is not there)."""
    monkeypatch.delenv("AFDC_TOKEN", raising=False)
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "afdc.cli", "serve", str(artifact), "--role", "ffn", "--rank", "0",
           "--rendezvous", address, "--join-timeout", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * JOIN_TIMEOUT)
    assert done.returncode == 2, done.stderr
    assert "error: no deployment token" in done.stderr and "--insecure-no-token" in done.stderr
    done = subprocess.run([*cmd, "--insecure-no-token"], capture_output=True, text=True, timeout=2 * JOIN_TIMEOUT)
    assert done.returncode == 2 and "cannot reach the rendezvous store" in done.stderr, done.stderr
    layout, deployment = deployment_of(artifact)
    with pytest.raises(RendezvousError, match=r"no deployment token.*--insecure-no-token"):
        Rendezvous(address, layout, deployment, None, host=True)
    host = Rendezvous(address, layout, deployment, None, host=True, insecure_no_token=True)
    assert host.token == "" and host.generation() == 0


@pytest.mark.parametrize("connector", ["shm", "gloo"])
def test_a_spare_takes_a_stalled_ffn_rank_over_and_the_original_leaves(artifact, tmp_path, connector):
    """A hot spare (``afdc serve --role ffn --spare``) waits beside FFN rank 0. The rank stalls
    (SIGSTOP, its process alive): the attention side loses it after ``--timeout`` and records the
    loss; the spare claims the rank through the store (one compare-and-set), loads its weights
    and serves it, and the tokens are the in-process ones. The original, resumed (SIGCONT), finds
    its claim fenced off and exits instead of serving beside the spare."""
    import os
    import signal

    from afdc.runtime.options import RuntimeOptions

    dm = afdc.load_deployment(artifact)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    ref = dm.generate(ids, max_new_tokens=4, pad_token_id=0)  # the FFN layers in process
    address, timeout = f"127.0.0.1:{free_port()}", 3.0
    dm.connect(RuntimeOptions(connector=connector, rendezvous=address, token="t", timeout=timeout, join_timeout=60),
               host=True)
    cmd = [sys.executable, "-m", "afdc.cli", "serve", str(artifact), "--role", "ffn", "--rendezvous", address,
           "--token", "t", "--connector", connector, "--timeout", str(timeout), "--join-timeout", "60"]
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("original", "spare")}  # noqa: SIM115
    original = subprocess.Popen([*cmd, "--rank", "0"], stderr=logs["original"])
    spare = subprocess.Popen([*cmd, "--spare"], stderr=logs["spare"])
    try:
        assert torch.equal(dm.generate(ids, max_new_tokens=4, pad_token_id=0), ref)
        while "waiting for a lost FFN rank" not in (tmp_path / "spare.log").read_text():
            assert spare.poll() is None, (tmp_path / "spare.log").read_text()
            time.sleep(0.1)
        os.kill(original.pid, signal.SIGSTOP)
        stalled = time.monotonic()
        with pytest.raises(PeerLost, match="ffn rank 0 lost"):
            dm.generate(ids, max_new_tokens=4, pad_token_id=0)
        got = dm.generate(ids, max_new_tokens=4, pad_token_id=0)  # regroups with whoever serves rank 0
        print(f"{connector}: a spare served the stalled rank {time.monotonic() - stalled:.1f} s after it stalled "
              f"(--timeout {timeout:g} s of it)")
        assert torch.equal(got, ref)
        assert re.search(r"spare: claimed ffn rank 0 \(pid \d+ on \S+ since generation \d+\)",
                         (tmp_path / "spare.log").read_text())
        os.kill(original.pid, signal.SIGCONT)
        assert original.wait(timeout=60) == 0
        assert "ffn rank 0: replaced (the slot is served by pid" in (tmp_path / "original.log").read_text()
        assert torch.equal(dm.generate(ids, max_new_tokens=4, pad_token_id=0), ref)  # still served, by the spare
        assert spare.poll() is None
    finally:
        dm.disconnect()
        for p in (original, spare):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.terminate()
            p.wait(timeout=60)
        for f in logs.values():
            f.close()
