"""Build the folder a GPU run carries so that afdc serves under vLLM there: ``.gpu-bundle/``.

The GPU machine has torch, transformers and triton but no vLLM and no network, and a run takes at
most 64 MiB with the repository. afdc's platform and worker bring their own kernels and never load
vLLM's compiled extensions (``vllm._C``, FlashInfer, ...), so what serving needs of vLLM is its
Python: this script packs the installed ``vllm`` package's Python modules and templates (no ``.so``,
no bundled Rust server, no CUDA/C++ headers, no fused-MoE tuning tables) as ``vllm.tar.gz``, and
downloads Python 3.12 manylinux wheels of each serving dependency that the GPU image lacks
(``benchmarks/gpu_image_packages.txt``), at the versions installed here (the ones CI tests).
The dependencies are the closure, over this environment's metadata, of the distributions a served
run imports (:data:`SERVED_IMPORTS`), less what the image has.

Run it where ``pip install -e ".[serve]"`` was done and PyPI is reachable:

    python benchmarks/gpu_bundle.py [--out .gpu-bundle] [--python-version 3.12]

then, on the GPU machine (``carry: [".gpu-bundle"]``), once per run:

    bash .gpu-bundle/install.sh && export PYTHONPATH=/tmp/afdc-site

``install.sh`` installs the wheels and vLLM's Python into ``/tmp/afdc-site`` and afdc itself
(editable, no dependencies, so vLLM finds its platform plugin entry point).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
import tarfile
from pathlib import Path

# What a served run imports beyond the GPU image (API server, engine core, afdc's worker and
# platform), by distribution; their own requirements follow from the metadata.
SERVED_IMPORTS = (
    "fastapi", "starlette", "uvicorn", "pydantic", "openai", "msgspec", "pyzmq", "xgrammar", "llguidance",
    "partial-json-parser", "watchfiles", "pybase64", "python-multipart", "cbor2", "openai-harmony", "blake3",
    "setproctitle", "lark", "prometheus-fastapi-instrumentator", "email-validator", "cachetools", "dill", "jsonschema",
    "model-hosting-container-standards", "pydantic-extra-types",
)
# never carried: the image has its own build of these, or they are compiled kernels afdc never calls
NEVER = {"torch", "torchvision", "torchaudio", "triton", "transformers", "numpy"}
LIMIT_MIB = 48
IMAGE = Path(__file__).with_name("gpu_image_packages.txt")
# vLLM's files that serving does not read: compiled extensions, its Rust front end, C++/CUDA
# sources of its kernels, web assets, and tuning tables of kernels afdc does not run
VLLM_SKIP = re.compile(
    r"(\.so$|\.pyc$|/__pycache__/|^vllm/vllm-rs|\.(hpp|h|cuh|cu|cpp|cc|inl|js|css)$"
    r"|^vllm/model_executor/layers/(fused_moe|quantization/utils)/configs/)"
)
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux1_x86_64")
INSTALL = """#!/usr/bin/env bash
# Installs what gpu_bundle.py packed, on a machine without network: run from the repository root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
site=${AFDC_SITE:-/tmp/afdc-site}  # PYTHON: the interpreter to install for (default python3)
mkdir -p "$site"
"${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
  --target "$site" "$here"/wheels/*.whl
tar -xzf "$here/vllm.tar.gz" -C "$site"
# afdc itself, editable and without dependencies: vLLM finds its platform through the entry point
"${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-build-isolation -e "$(dirname "$here")"
echo "installed into $site: export PYTHONPATH=$site"
"""


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = IMAGE.read_text().splitlines()
    return {canonical(line) for line in lines if line.strip() and not line.startswith("#")}


def closure(roots: tuple[str, ...], have: set[str]) -> dict[str, str]:
    """Distribution -> installed version: ``roots`` and their requirements (no extras, markers for
    Linux x86-64), as installed here, less ``have`` and :data:`NEVER`."""
    from packaging.markers import Marker  # pip's vendored copy is not public; packaging ships with setuptools

    env = {"python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "extra": ""}
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonical(todo.pop())
        if name in found or name in have or name in NEVER:
            continue
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: run this where `pip install -e '.[serve]'` ran") from None
        for req in md.requires(name) or []:
            marker = req.split(";", 1)[1] if ";" in req else None
            if marker is None or Marker(marker).evaluate(env):
                todo.append(_name(req))
    return found


def download(wanted: dict[str, str], python_version: str, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation",
           "cp", "--python-version", python_version, "-d", str(into)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + [f"{n}=={v}" for n, v in sorted(wanted.items())], check=True)


def pack_vllm(out: Path) -> int:
    """vLLM's installed Python files (and its dist-info) as a tar.gz; returns the files packed."""
    dist = md.distribution("vllm")
    root = Path(dist.locate_file(""))
    files = [f for f in dist.files or []
             if ".." not in f.parts and not VLLM_SKIP.search(str(f)) and (root / f).is_file()]
    with tarfile.open(out, "w:gz") as tar:
        for f in files:
            tar.add(root / f, arcname=str(f))
    return len(files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(".gpu-bundle"))
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (wheels' tags)")
    args = ap.parse_args()
    if md.version("vllm") != "0.30.0":
        raise SystemExit(f"vllm {md.version('vllm')} is installed; afdc serves vllm 0.30.0")
    wanted = closure(SERVED_IMPORTS, image_packages())
    args.out.mkdir(parents=True, exist_ok=True)
    for old in (args.out / "wheels").glob("*.whl"):
        old.unlink()
    download(wanted, args.python_version, args.out / "wheels")
    count = pack_vllm(args.out / "vllm.tar.gz")
    (args.out / "install.sh").write_text(INSTALL)
    sizes = {p.name: p.stat().st_size for p in args.out.rglob("*") if p.is_file()}
    total = sum(sizes.values()) / 2**20
    print(f"{len(wanted)} wheels: " + ", ".join(f"{n}=={v}" for n, v in sorted(wanted.items())))
    print(f"vllm.tar.gz: {count} files, {sizes['vllm.tar.gz'] / 2**20:.1f} MiB; {args.out}: {total:.1f} MiB in all")
    if total > LIMIT_MIB:
        raise SystemExit(f"{args.out} is {total:.1f} MiB, over the {LIMIT_MIB} MiB a GPU run can carry beside the tree")


if __name__ == "__main__":
    main()
