"""The `cunorm` command's check: the correctness checker over the GPU, and --compile-only without one."""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import click
import numpy as np

import cunorm.cli as cli

from .. import dtypes
from ..dispatch import measured


@cli.main.command()
@click.option("--sizes", callback=cli._csv(int), help="Hidden sizes, comma-separated (default: the tuned table "
              "plus a heuristic sample).")
@click.option("--rows", callback=cli._csv(int), help="Row counts, comma-separated (default: 1,37,4096).")
@click.option("--dtypes", "dtype_names", callback=cli._csv(cli._dtype_list), help="Input dtypes: fp64,fp32,fp16,bf16 (default all).")
@click.option("--op", "--ops", "ops", type=click.Choice(list(cli.OP_NAMES)), multiple=True,
              help="Only these ops (repeatable): LayerNorm fwd/bwd, RMSNorm rms/rms-bwd, attention delta.")
@click.option("--sweep", "sweeps", type=click.Choice(["tuned", "general", "flags", "pairwise"]), multiple=True,
              help="Only these sweeps (repeatable; default all): tuned (the dispatch table and a heuristic "
                   "sample), general (any N, row layouts, weight layouts, dtype mixes, in place), flags "
                   "(RMSNorm, residual, zero-centered weights), pairwise (every tensor's dtype and layout "
                   "drawn independently, all pairs covered).")
@click.option("--seed", type=int, default=None, help="Random seed (default: fresh).")
@click.option("--compile-only", is_flag=True, help="Compile every variant with NVRTC (no GPU) and report "
              "registers and spills.")
@click.option("--arch", default="sm_90", show_default=True, help="Target architecture for --compile-only.")
@click.option("--source", "source_file", type=click.Path(exists=True, dir_okay=False),
              help="An edited copy of kernels/norm_fwd.cu or norm_bwd.cu to check in place of the shipped one "
                   "(the ops it serves).")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
def check(sizes, rows, dtype_names, ops, sweeps, seed, compile_only, arch, source_file, as_json):
    """Check the kernels against the float64 reference (exit 0: all pass, 1: a failure, 3: no GPU)."""
    from ..check import OPS, SWEEPS, default_cases, source_ops

    op_names = tuple(cli.OP_NAMES[o] for o in ops) or OPS
    source = None
    if source_file:
        with open(source_file) as f:
            source = f.read()
        try:
            served = source_ops(source)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--source") from None
        op_names = tuple(o for o in op_names if o in served) or served
    if sizes and min(sizes) < 1:
        raise click.BadParameter(f"hidden sizes must be >= 1, got {min(sizes)}", param_hint="--sizes")
    cases = default_cases(sizes, rows or (1, 37, 4096), dtype_names or dtypes.NAMES, op_names,
                          sweeps=sweeps or SWEEPS)
    if compile_only:
        sys.exit(_compile_only(cases, cli._arch(arch), as_json, source))
    if cli.gpu_missing("cunorm check", as_json, "use --compile-only to check compilation without one"):
        sys.exit(cli.EXIT_NO_GPU)
    from ..check import precompile, run_case

    rng = np.random.default_rng(seed)
    precompile(cases, source=source)
    results = []
    with click.progressbar(cases, label="checking", file=sys.stderr) as bar:
        for case in bar:
            results += run_case(case, rng, source)
    failed = [r for r in results if not r.ok]
    if as_json:
        click.echo(json.dumps({"results": [r.as_dict() for r in results], "failed": len(failed)}, indent=1))
    else:
        click.echo(f"{'case':<100} {'output':<12} {'rel-L2':>10} {'tol':>8}  result")
        for r in results:
            click.echo(f"{r.case.label():<100} {r.output:<12} {r.error:>10.2e} {r.tolerance:>8.0e}  "
                       f"{'PASS' if r.ok else 'FAIL'}")
        click.echo(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(cli.EXIT_FAIL if failed else 0)


def _report(traits, arch: int, source):
    """The ptxas report of `traits` on `arch`, or the error that stopped it."""
    from ..compiler import CompileError, compile_only

    try:
        return compile_only(traits, arch, source)
    except (CompileError, ValueError) as e:
        return e


def _compile_only(cases, arch, as_json, source=None) -> int:
    """Compiles every distinct variant the cases run on `arch` and says, of
    each, what happened: compiled clean, compiled with spills (a failure for a
    tuned entry; a heuristic last resort may spill), refused (dispatch has no
    legal traits there: not compiled, so not a pass), or failed to compile.
    Exit 1 when anything failed or nothing compiled."""
    from ..check import case_kernels

    rows, reports = [], {}

    def report_of(traits):  # compiled once, whether asked for by the spill fallback or by the loop
        if traits not in reports:
            reports[traits] = _report(traits, arch, source)
        return reports[traits]

    def spills(traits) -> bool:
        report = report_of(traits)
        return not isinstance(report, Exception) and not report.clean

    # Compile every first pick in parallel first (NVRTC runs outside the GIL), so the pass below, which may
    # ask for a fallback's report, finds them done.
    firsts = {t for t, _ in case_kernels(cases, arch) if not isinstance(t, ValueError)}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for traits, report in zip(firsts, pool.map(_report, firsts, [arch] * len(firsts),
                                                    [source] * len(firsts))):
            reports[traits] = report
    variants = list(case_kernels(cases, arch, None if source is not None else spills))
    with click.progressbar(variants, label=f"compiling for sm_{arch}", file=sys.stderr) as bar:
        for traits, origin in bar:
            if isinstance(traits, ValueError):
                rows.append({"source": origin, "verdict": "refused", "error": str(traits)})
                continue
            row = {"label": traits.short(), "traits": traits.knobs(), "source": origin,
                   "kernels": sorted(traits.launches())}
            report = report_of(traits)
            if isinstance(report, Exception):
                rows.append({**row, "verdict": "failed", "error": str(report)})
                continue
            spills = not report.clean
            verdict = "clean" if not spills else "failed: a tuned entry spills" if measured(origin) else "spills"
            rows.append({**row, "verdict": verdict, "spills": spills,
                         "spill_bytes": sum(f.spill_stores + f.spill_loads for f in report.functions),
                         "functions": [f.__dict__ for f in report.functions]})
    count = lambda pred: sum(1 for r in rows if pred(r["verdict"]))  # noqa: E731
    summary = {"compiled": count(lambda v: v != "refused" and v != "failed"), "refused": count(lambda v: v == "refused"),
               "spilled": sum(1 for r in rows if r.get("spills")), "failed": count(lambda v: v.startswith("failed"))}
    failed = summary["failed"] > 0 or summary["compiled"] == 0
    if as_json:
        click.echo(json.dumps({"arch": arch, **summary, "ok": not failed, "variants": rows}, indent=1))
    else:
        click.echo(f"{'variant':<100} {'kernel':<24} {'regs':>4} {'stack':>5} {'spill':>5}  result")
        for r in rows:
            if r["verdict"] == "refused":
                click.echo(f"refused on sm_{arch} (not compiled): {r['error']}")
                continue
            label = f"{r['label']} ({r['source']})"
            if "functions" not in r:
                click.echo(f"{label:<100} FAILED {r['error'].splitlines()[0]}")
                continue
            for f in r["functions"]:
                spill = f["spill_stores"] + f["spill_loads"]
                clean = not spill and not f["stack_frame"]
                verdict = "ok" if clean else "FAIL (tuned entry spills)" if measured(r["source"]) else "spills"
                click.echo(f"{label:<100} {f['name']:<24} {f['registers']:>4} {f['stack_frame']:>5} {spill:>5}  "
                           f"{verdict}")
        click.echo(f"sm_{arch}: {summary['compiled']} compiled ({summary['spilled']} with spills), "
                   f"{summary['refused']} refused (not compiled), {summary['failed']} failed"
                   + ("; nothing compiled" if not summary["compiled"] else ""))
    return cli.EXIT_FAIL if failed else 0
