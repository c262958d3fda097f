"""Mutation testing of CUDA-only code on the GPU machine: each mutant (an exact-text change to one src file) goes into
its own copy of src, and its CUDA tests run against it with -x; KILLED = a test failed, SURVIVED = they all passed.
Each distinct test selection first runs once unmutated (a mutant is run only when its baseline passed).

Usage (repo root, device tool):  python3 benchmarks/run_cuda_mutants.py SPEC.json [ID ...]
SPEC: [{"id", "file", "old", "new", "why", "tests"}], "tests" a pytest argument string. Logs go to $OUT/mut/,
a summary to stdout. JOBS (default 4) mutants at a time. Session 41's spec:
benchmarks/results/logs/cuda_mutants_session41.json (log_gpu_mutants_cuda_session41.txt).
"""
import concurrent.futures as cf
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path


def run(tag: str, src: Path, tests: str, log: Path, timeout: int) -> tuple[int, float, list[str]]:
    env = {**os.environ, "PYTHONPATH": f"{src}:{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    t = time.time()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rs",
                            *shlex.split(tests)], env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, str(e.stdout or "")
    (log / f"{tag}.txt").write_text(out)
    tail = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR", "E ")) or " passed" in ln
            or " failed" in ln]
    return rc, time.time() - t, tail[-4:]


def mutant(m: dict, log: Path) -> tuple[int, float, list[str]]:
    d = Path("/tmp/cuda_mutants") / m["id"]
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree("src", d / "src")
    f = d / m["file"]
    text = f.read_text()
    if text.count(m["old"]) != 1:
        return -1, 0.0, [f"old text occurs {text.count(m['old'])} times in {m['file']}: the spec is stale"]
    f.write_text(text.replace(m["old"], m["new"]))
    return run(m["id"], d / "src", m["tests"], log, 300)


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("run_cuda_mutants.py needs a CUDA GPU: its mutants are in CUDA-only code, whose tests skip here")
    if len(sys.argv) < 2:
        sys.exit("usage: python3 benchmarks/run_cuda_mutants.py SPEC.json [ID ...]")
    spec, only = json.loads(Path(sys.argv[1]).read_text()), set(sys.argv[2:])
    spec = [m for m in spec if not only or m["id"] in only]
    log = Path(os.environ.get("OUT", "/tmp")) / "mut"
    log.mkdir(parents=True, exist_ok=True)
    jobs, t0 = int(os.environ.get("JOBS", 4)), time.time()
    sels = sorted({m["tests"] for m in spec})
    with cf.ThreadPoolExecutor(jobs) as ex:
        base = dict(zip(sels, ex.map(lambda s: run(f"base_{sels.index(s)}", Path("src").resolve(), s, log, 420),
                                     sels)))
    for s, (rc, sec, tail) in base.items():
        print(f"== BASE rc={rc} {sec:.0f}s  {s}", *(f"   | {ln[:200]}" for ln in tail), sep="\n")
    todo = [m for m in spec if base[m["tests"]][0] == 0]
    with cf.ThreadPoolExecutor(jobs) as ex:
        results = list(ex.map(lambda m: mutant(m, log), todo))
    for m, (rc, sec, tail) in zip(todo, results):
        status = {0: "SURVIVED", 5: "NO-TESTS", -1: "STALE"}.get(rc, "KILLED")
        print(f"== {m['id']} {status} rc={rc} {sec:.0f}s  {m['file']}: {m['why']}\n   pytest {m['tests']}",
              *(f"   | {ln[:200]}" for ln in tail), sep="\n")
    print(f"# {len(todo)} mutants in {time.time() - t0:.0f}s, JOBS={jobs}")


if __name__ == "__main__":
    main()
