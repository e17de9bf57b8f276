"""The `cunorm` command's info (versions, NVRTC, GPUs) and list (the dispatch table and where each row came from)."""
from __future__ import annotations

import json
import sys

import click
import numpy as np

import cunorm.cli as cli

from .. import dispatch, dtypes


@cli.main.command()
@click.option("--json", "as_json", is_flag=True)
def info(as_json):
    """Versions, GPU, NVRTC and architecture."""
    import platform

    from .. import __version__
    from ..source import kernel_dir

    out = {"cunorm": __version__, "python": platform.python_version(), "numpy": np.__version__,
           "kernels": str(kernel_dir())}
    cupy = None
    try:
        import cupy

        out["cupy"] = cupy.__version__
        from cupy_backends.cuda.libs import nvrtc

        out["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
    except Exception as e:  # report, don't fail: info is for bug reports
        out.setdefault("cupy", None)
        out["nvrtc"] = f"unavailable ({type(e).__name__}: {e})"
    out["gpus"] = []
    for i in range(cli.gpu_count()):
        d = cupy.cuda.Device(i)
        props = cupy.cuda.runtime.getDeviceProperties(i)
        out["gpus"].append({"id": i, "name": props["name"].decode(), "arch": f"sm_{d.compute_capability}",
                            "sms": d.attributes["MultiProcessorCount"],
                            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1)})
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    for k, v in out.items():
        if k != "gpus":
            click.echo(f"{k:<8} {v}")
    if not out["gpus"]:
        click.echo("gpu      none found")
    for g in out["gpus"]:
        click.echo(f"gpu {g['id']:<4} {g['name']} ({g['arch']}, {g['sms']} SMs, {g['memory_gib']} GiB)")


@cli.main.command(name="list")
@click.option("--arch", default="sm_90", show_default=True, help="Architecture the dispatch is for.")
@click.option("--gpu", "model", metavar="MODEL",
              help="A GPU model cunorm ships a table for (a part of its name: h100, h200), listed as dispatch "
                   "would pick on it (with your table for it, if any); its architecture replaces --arch. "
                   "Default: this machine's GPU, when it is of --arch.")
@click.option("--json", "as_json", is_flag=True)
def list_(arch, model, as_json):
    """The dispatch table: traits per hidden size, dtype and op (LayerNorm and RMSNorm, forward and backward)."""
    from ..sweeps import SHORT_NAMES
    from ..tables import shipped_gpus
    from ..traits_rules import MIN_ARCH

    gpu = None
    if model is not None:
        found = [g for g in shipped_gpus() if model.lower() in g.name.lower()]
        if len(found) != 1:
            names = ", ".join(g.name for g in shipped_gpus())
            raise click.BadParameter(f"{model!r} names {len(found)} of the GPU models with a shipped table "
                                     f"({names})", param_hint="--gpu")
        gpu = found[0]
        arch = f"sm_{gpu.cc}"
    arch = cli._arch(arch)

    if arch < MIN_ARCH:
        message = f"sm_{arch}: no kernel of this table runs there (the normalization kernels need sm_{MIN_ARCH} or newer)"
        click.echo(json.dumps({"arch": arch, "error": message, "rows": []}) if as_json else message)
        sys.exit(cli.EXIT_FAIL)
    if gpu is None:
        gpu = cli._gpu_of_arch(arch)
    from ..tables import tables_for

    tables = [t.origin for t in tables_for(gpu)]
    rows = []
    for n in dispatch.TUNED_SIZES:
        for dt in dtypes.NAMES:
            for op, (name, backward) in SHORT_NAMES.items():  # the ops as `cunorm tune --ops` names them
                row, rms = {"hidden_size": n, "dtype": dt, "op": op}, name == "rms_norm"
                try:
                    t, source = dispatch.choose(hidden_size=n, input_dtype=dt, weight_dtype=dt, output_dtype=dt,
                                                backward=backward, rms=rms, has_bias=not rms, arch=arch, gpu=gpu)
                except ValueError as e:
                    rows.append({**row, "source": "unsupported", "error": str(e)})
                    continue
                rows.append({**row, "source": source, **t.knobs(), "ldgs": t.ldgs,
                             "threads_per_cta": t.threads_per_cta})
    if as_json:
        click.echo(json.dumps({"arch": arch, "gpu": None if gpu is None else gpu.as_dict(), "tables": tables,
                               "rows": rows}, indent=1))
        return
    click.echo(f"# sm_{arch}" + ("" if gpu is None else f", {gpu.name}") + ": "
               + ("; ".join(tables) + ", then " if tables else "") + "the sm_90 literal (tuned.py), the heuristic")
    click.echo(f"{'N':>6} {'dtype':<9} {'op':<7} {'WARPS_M':>7} {'WARPS_N':>7} {'CTAS/ROW':>8} {'B/LDG':>5} "
               f"{'LDGS':>4} {'threads':>7} {'grid':<8}  source")
    for r in rows:
        if r["source"] == "unsupported":
            click.echo(f"{r['hidden_size']:>6} {r['dtype']:<9} {r['op']:<7} unsupported: {r['error']}")
            continue
        click.echo(f"{r['hidden_size']:>6} {r['dtype']:<9} {r['op']:<7} {r['warps_m']:>7} {r['warps_n']:>7} "
                   f"{r['ctas_per_row']:>8} {r['bytes_per_ldg']:>5} {r['ldgs']:>4} {r['threads_per_cta']:>7} "
                   f"{'one wave' if r['persistent'] else 'unstaged':<8}  "
                   f"{r['source']}")
