"""Tables, chart and result files of a bench run (JSON + markdown + PNG, named with GPU and date).

Rows come from the workers; here they get MFU (against the matmul peak measured in the same run) and
are formatted. Versions are read from package metadata, never by importing (Unsloth must come first).
"""

from __future__ import annotations

import datetime as _dt
import glob
import importlib.metadata
import json
import math
import os
import platform
import subprocess
from pathlib import Path

from .._jsonio import atomic_open, write_text_atomic

PACKAGES = ("torch", "triton", "transformers", "peft", "liger-kernel", "unsloth", "unsloth_zoo", "tokenizers")
COLUMNS = ("contender", "method", "tokens/s", "MFU", "peak GiB", "min grad norm", "loss first -> last", "status")


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def git_sha() -> str:
    """Short sha of the checkout this package runs from, "-dirty" added when its tracked files differ from that
    commit; env CHRONICALS_GIT_SHA, when set, wins: a copied working tree (the GPU machine's) can carry a .git whose
    HEAD is older than the files that ran. A package not in its own checkout (installed into a venv inside another
    git project: that project's sha was written; a bench walk) gives "v<version>" instead."""
    if os.environ.get("CHRONICALS_GIT_SHA"):
        return os.environ["CHRONICALS_GIT_SHA"]
    here = Path(__file__).resolve().parent

    def git(*argv: str) -> str:
        return subprocess.check_output(["git", *argv], text=True, stderr=subprocess.DEVNULL, cwd=here).strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel")).resolve()
        if (top / "src" / "chronicals").resolve() != here.parent:
            raise OSError("not chronicals' own checkout")
        sha = git("rev-parse", "--short", "HEAD")
        return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        try:
            from importlib.metadata import version

            return f"v{version('chronicals')}"
        except Exception:
            return "unknown"


def finite_json(x):
    """``x`` with every non-finite float as its text ("nan", "inf"): json.dumps wrote a bare NaN, which strict
    parsers (jq, JavaScript) refuse, exactly in a FAILED row's grad norms (a bench walk)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x


def finish_row(row: dict, peak_tflops: float | None) -> dict:
    """Add MFU and the physical limit (tokens/s at 100% of the measured peak) to a measured row."""
    fpt = row.get("flops_per_token")
    if peak_tflops and fpt:
        row["limit_tokens_per_s"] = peak_tflops * 1e12 / fpt
        if row.get("tokens_per_s"):
            row["mfu"] = row["tokens_per_s"] * fpt / (peak_tflops * 1e12)
    return row


def _num(x, fmt: str, missing: str = "n/a") -> str:
    return missing if x is None else str(x) if isinstance(x, float) and not math.isfinite(x) else format(x, fmt)


def status_cell(row: dict) -> str:
    st = row.get("status") or "?"
    return st if st == "ok" or not row.get("reason") else f"{st}: {row['reason']}".replace("|", "/")


def table_cells(row: dict) -> dict:
    losses = row.get("losses") or []
    measured = row.get("tokens_per_s") is not None
    return {"contender": row.get("label", row["contender"]) + (" (ckpt)" if row.get("checkpointing") else ""),
            "method": row.get("method", ""),
            "tokens/s": _num(row.get("tokens_per_s"), ",.0f", ""),
            "MFU": _num(100 * row["mfu"], ".1f") + "%" if row.get("mfu") is not None else ("n/a" if measured else ""),
            "peak GiB": _num(row.get("peak_gib"), ".1f", "n/a" if measured else ""),
            "min grad norm": _num(row.get("min_grad_norm"), ".3g", ""),
            "loss first -> last": f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "",
            "status": status_cell(row)}


def markdown_table(rows: list[dict], columns=COLUMNS) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(str(c[k]) for k in columns) + " |\n" for c in map(table_cells, rows))


def table_markdown(table: dict, peak_tflops: float | None) -> str:
    rows = table["rows_data"]
    lines = [f"### {table['title']}", ""]
    limits = {r["method"]: r["limit_tokens_per_s"] for r in rows if r.get("limit_tokens_per_s") and r.get("method")}
    fpts = {r["method"]: r["flops_per_token"] for r in rows if r.get("flops_per_token") and r.get("method")}
    for m in sorted(fpts):
        lim = f", limit {limits[m]:,.0f} tokens/s at the measured peak" if m in limits else ""
        basis = "6 x matmul params + attention" if m == "full" else \
            "4 x matmul params + attention: frozen weights have no weight-gradient GEMM"
        lines.append(f"- {m}: {fpts[m] / 1e9:.3g} GFLOP per token ({basis}){lim}")
    if any(r.get("graph_pool_gib") for r in rows):
        lines.append("- peak GiB: the most allocated; for a CUDA-graph row at least what is allocated outside the "
                     "graph's memory pool plus all the pool reserves (a replay allocates nothing; the pool's size is "
                     "graph_pool_gib in the JSON)")
    lines += ["", markdown_table(rows)]
    return "\n".join(lines)


def correctness_markdown(res: dict) -> str:
    lines = [f"### Correctness: first step on the same weights and batch ({res.get('rows')} x {res.get('seq')}, "
             f"{res.get('shape')} shape; reference = transformers in fp32)", "",
             "| method | loss fp32 ref | loss transformers bf16 | loss chronicals | grad norm ref | transformers | "
             "chronicals | grad cosine transformers / chronicals | status |", "|---|---|---|---|---|---|---|---|---|"]
    for p in res.get("parity", []):
        if "loss_ref" not in p:
            lines.append(f"| {p['method']} | | | | | | | | {status_cell(p)} |")
            continue
        lines.append(f"| {p['method']} | {p['loss_ref']:.4f} | {p['loss_hf']:.4f} | {p['loss_ours']:.4f} | "
                     f"{p['grad_norm_ref']:.4g} | {p['grad_norm_hf']:.4g} | {p['grad_norm_ours']:.4g} | "
                     f"{p['grad_cos_hf']:.5f} / {p['grad_cos_ours']:.5f} | {status_cell(p)} |")
    if res.get("status") not in ("ok", "FAILED"):
        lines.append(f"\n{status_cell(res)}")
    return "\n".join(lines) + "\n"


def learning_markdown(res: dict) -> str:
    lines = [f"### Learning check: chronicals on a periodic sequence ({res.get('rows')} x {res.get('seq')}, "
             f"{res.get('steps')} steps, {res.get('shape')} shape)", "",
             "| method | loss first -> last | min grad norm | status |", "|---|---|---|---|"]
    for r in res.get("runs", []):
        ls = r.get("losses") or []
        lines.append(f"| {r['method']} | {f'{ls[0]:.3f} -> {ls[-1]:.3f}' if ls else ''} | "
                     f"{_num(r.get('min_grad_norm'), '.3g', '')} | {status_cell(r)} |")
    if res.get("status") not in ("ok", "FAILED"):
        lines.append(f"\n{status_cell(res)}")
    return "\n".join(lines) + "\n"


def report_markdown(results: dict) -> str:
    env, peak = results["environment"], results.get("peak_tflops")
    vers = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    out = [f"## chronicals bench, {env['gpu']}, {env['date']} (git {env['git_sha']})", "",
           f"Versions: {vers}.", "",
           f"bf16 matmul peak measured in this run: {_num(peak, '.0f')} TFLOP/s." if peak else
           "No GPU: MFU not computed (no matmul peak on this device).", "",
           "Protocol: random init, bf16 weights, rows x seq tokens per step with no padding (labels = inputs: "
           "rows x (seq - 1) loss tokens, counted for every contender alike), torch AdamW(fused=True), "
           f"{results['plan']['warmup']} warm-up + {results['plan']['steps']} timed steps between synchronizations. "
           "A row is FAILED when its smallest gradient norm over the timed steps is not finite or is 0.", ""]
    if results.get("complete") is False:
        out += ["**Partial**: written as the run went; it had not finished (cut short, or still running).", ""]
    if results["plan"].get("note"):
        out += [results["plan"]["note"], ""]
    for t in results.get("tables", []):
        out += [table_markdown(t, peak), ""]
    if results.get("correctness"):
        out += [correctness_markdown(results["correctness"]), ""]
    if results.get("learning"):
        out += [learning_markdown(results["learning"]), ""]
    if results.get("max_context"):
        out += ["### Longest trainable context (1 row, checkpointing on)", "",
                "| shape | contender | longest seq that trained | its peak GiB | its tokens/s | first failure |",
                "|---|---|---|---|---|---|"]
        out += [f"| {m['shape']} | {m['contender']} | {m['max_ok'] or 'none'} | {_num(m.get('peak_gib'), '.1f')} | "
                f"{_num(m.get('tokens_per_s'), ',.0f')} | {m['first_failure'] or _num(m.get('cap'), ',', '') + ' is the cap'} |"
                for m in results["max_context"]]
    return "\n".join(out) + "\n"


def plot_png(results: dict, path: Path) -> Path | None:
    """One horizontal bar chart of tokens/s per table; FAILED rows hatched, the limit as a dashed line."""
    tables = [t for t in results.get("tables", []) if any(r.get("tokens_per_s") for r in t["rows_data"])]
    if not tables:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tables), 1, figsize=(9, 1.2 + 0.45 * sum(len(t["rows_data"]) for t in tables)),
                             squeeze=False)
    for ax, t in zip(axes[:, 0], tables):
        rows = [r for r in t["rows_data"] if r.get("tokens_per_s")]
        names = [table_cells(r)["contender"] + f" [{r.get('method', '')}]" for r in rows]
        vals = [r["tokens_per_s"] for r in rows]
        colors = ["tab:green" if r["contender"].startswith("chronicals") else "tab:gray" for r in rows]
        bars = ax.barh(names, vals, color=colors)
        for b, r in zip(bars, rows):
            if r.get("status") != "ok":
                b.set_hatch("//")
                b.set_color("tab:red")
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {b.get_width():,.0f}", va="center", fontsize=8)
        for m, style in (("full", "--"), ("lora", ":")):
            lim = next((r.get("limit_tokens_per_s") for r in rows if r.get("method") == m and r.get("limit_tokens_per_s")), None)
            if lim:
                ax.axvline(lim, color="k", linestyle=style, linewidth=1, label=f"{m} limit {lim:,.0f}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
        ax.invert_yaxis()
        ax.set_title(t["title"], fontsize=9)
        ax.set_xlabel("tokens/s (loss tokens)")
    env = results["environment"]
    fig.suptitle(f"chronicals bench: {env['gpu']}, {env['date'][:10]}, git {env['git_sha']}", fontsize=10)
    fig.tight_layout()
    try:
        with atomic_open(path, "wb") as fh:  # whole or not at all, as the JSON and markdown
            fig.savefig(fh, dpi=120, format="png")
    finally:
        plt.close(fig)
    return path


def output_stem(results: dict, out_dir: Path, name: str = "bench_e2e") -> Path:
    """<out_dir>/<name>_<gpu>_<date>, or with _2, _3, ... after it when an earlier run's files hold that name (a
    second run of one plan on the same day would overwrite the first's results). The name is claimed by creating
    its .json empty (O_EXCL), so two runs choosing at once cannot both take it; write_report then fills it."""
    gpu = "".join(c if c.isalnum() or c in "-_." else "-" for c in results["environment"]["gpu"])
    base = f"{name}_{gpu}_{results['environment']['date'][:10]}"
    taken = {p.name for p in Path(out_dir).glob(f"{glob.escape(base)}*")} if Path(out_dir).is_dir() else set()
    stem, n = base, 1
    while True:
        if not any(stem + ext in taken for ext in (".json", ".md", ".png")):
            try:
                os.close(os.open(Path(out_dir) / f"{stem}.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                return Path(out_dir) / stem
            except FileExistsError:  # another run claimed it since the listing
                pass
        n += 1
        stem = f"{base}_{n}"


def write_report(results: dict, out_dir: str | os.PathLike, name: str = "bench_e2e", stem: Path | None = None,
                 chart: bool = True) -> dict[str, Path]:
    """Write <name>_<gpu>_<date>[_n].json/.md/.png under ``out_dir``, each whole (temporary file, then rename);
    returns the paths written. ``stem``: the files of an earlier write of this run, written over (``bench.cli``
    writes after each table and check, so a run cut short keeps what it finished); ``chart``: the PNG too."""
    out_dir = Path(out_dir).expanduser()  # '~/x' made ./~/x here while the write went to $HOME/x (a bench walk)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or output_stem(results, out_dir, name)
    # append, never with_suffix: a shape name such as "0.5b" holds a dot that with_suffix would cut at
    paths = {"json": stem.with_name(stem.name + ".json"), "md": stem.with_name(stem.name + ".md")}
    write_text_atomic(paths["json"], json.dumps(finite_json(results), indent=1, default=str))
    write_text_atomic(paths["md"], report_markdown(results))
    png = plot_png(results, stem.with_name(stem.name + ".png")) if chart else None
    if png:
        paths["png"] = png
    return paths


def environment(gpu: str) -> dict:
    return {"gpu": gpu, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "git_sha": git_sha(), "versions": versions()}
