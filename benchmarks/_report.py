"""Tables, ratios and targets for bench_save_load.py, as Markdown (printed and recorded)."""

from __future__ import annotations

import os

RAW = ("raw (one file)", "raw (file per tensor)")


def _fmt_case(case: dict, data_bytes: int, title: str) -> list[str]:
    ck = case["ckptcore"]
    warm = all("load_warm" in r for r in case.values())
    lines = [f"### {title}", "",
             "| contender | file MiB | save s (median / best) | save GB/s | load s (median / best) "
             "| load GB/s | ckptcore faster, save | ckptcore faster, load |"
             + (" warm load s (median / best) | ckptcore faster, warm load |" if warm else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if warm else "")]
    for name, r in case.items():
        s, lo = r["save"], r["load"]
        line = (f"| {name} | {r['bytes'] / 2**20:.1f} | {s['median']:.3f} / {s['best']:.3f} "
                f"| {data_bytes / s['median'] / 1e9:.2f} | {lo['median']:.3f} / {lo['best']:.3f} "
                f"| {data_bytes / lo['median'] / 1e9:.2f} | {s['best'] / ck['save']['best']:.2f}x "
                f"| {lo['best'] / ck['load']['best']:.2f}x |")
        if warm:
            w = r["load_warm"]
            line += (f" {w['median']:.3f} / {w['best']:.3f} "
                     f"| {w['best'] / ck['load_warm']['best']:.2f}x |")
        lines.append(line)
    return lines + [""]


def _fmt_restore(case: dict) -> list[str]:
    lines = ["### Cold restore into live objects (NumPy reference adapter)", "",
             "| how | restore s (median / best) | all rounds |", "|---|---:|---|"]
    for name, r in case.items():
        lo = r["load"]
        lines.append(f"| {name} | {lo['median']:.3f} / {lo['best']:.3f} | "
                     + ", ".join(f"{x:.3f}" for x in lo["all"]) + " |")
    return lines + [""]


def _ratio(slow: dict, fast: dict, op: str) -> tuple[float, float]:
    """``slow``'s time over ``fast``'s, from the best and from the median round."""
    return (slow[op]["best"] / fast[op]["best"], slow[op]["median"] / fast[op]["median"])


def _raw_baseline(case: dict, op: str) -> str:
    """The faster raw variant (by best time) for ``op``: the stricter baseline."""
    return min((n for n in RAW if n in case), key=lambda n: case[n][op]["best"])


def targets(results: dict) -> list[tuple[str, str, bool | None]]:
    """``(target, measured, met)`` rows; ``met`` is None when informative or not measured.

    Ratios are judged on the best round of each contender (interference from other work on a
    shared machine only ever adds time); the median-based ratio is shown next to it.
    """
    rows: list[tuple[str, str, bool | None]] = []
    if "large" in results:
        rows += _large_targets(results)
    if "small" in results:
        rows += _small_targets(results)
    if "restore" in results:
        rows += _restore_targets(results)
    if "peak_memory" in results:
        rows += _memory_targets(results)
    return rows


def _large_targets(results: dict) -> list[tuple[str, str, bool | None]]:
    large = results["large"]
    ck = large["ckptcore"]
    rows = []
    for op, verb in (("save", "save >= 0.9x raw write+fsync"),
                     ("load", "cold load >= 0.9x raw read")):
        name = _raw_baseline(large, op)
        best, med = _ratio(large[name], ck, op)
        rows.append((verb, f"{best:.2f}x (median {med:.2f}x; vs {name})", best >= 0.9))
    for fw, need in (("tf.train.Checkpoint", 2.0), ("paddle.save", 3.0)):
        for op in ("save", "load"):
            label = (f"save >= {need:g}x faster than {fw}" if op == "save" else
                     f"load vs {fw.split('.save')[0]}{'.load' if 'paddle' in fw else '.read'} "
                     "(informative: bounded by the disk)")
            if fw not in large:
                rows.append((label, "not run (not installed or --no-frameworks)", None))
                continue
            best, med = _ratio(large[fw], ck, op)
            met = best >= need if op == "save" else None
            rows.append((label, f"{best:.2f}x (median {med:.2f}x)", met))
    checks = results.get("checksums")
    for op in ("save", "load") if checks else ():
        share = checks["crc_alone"] / ck[op]["best"]
        rows.append((f"checksum cost, {op}: crc32c of the state on one thread / best {op} "
                     "(informative: the most it could add, were nothing to overlap it)",
                     f"{share:.1%}", None))
    for where, c in (checks or {}).items():
        if where == "crc_alone":
            continue
        for op in ("save", "load"):
            cost = c["cost_" + op]
            label = (f"checksum cost, {op}: disk pairs, with / without <= 10%"
                     if where == "disk" else
                     f"checksum cost, {op} (tmpfs: CPU only, worst case; informative)")
            rows.append((label, f"{cost['median']:+.1%} (median of {len(cost['all'])} pairs; range "
                         f"{min(cost['all']):+.0%} to {max(cost['all']):+.0%})",
                         cost["median"] <= 0.10 if where == "disk" else None))
    return rows


def _small_targets(results: dict) -> list[tuple[str, str, bool | None]]:
    rows = []
    small_case = results["small"]
    small = small_case["ckptcore"]
    if "safetensors.numpy" in small_case:
        st = small_case["safetensors.numpy"]
        for op, label in (("save", "small tensors: save (fsync) >= 1.0x safetensors.numpy (+ fsync)"),
                          ("load", "small tensors: cold load >= 1.0x safetensors.numpy"),
                          ("load_warm", "small tensors: warm load >= 1.0x safetensors.numpy")):
            if op in small and op in st:
                best, med = _ratio(st, small, op)
                rows.append((label, f"{best:.2f}x (median {med:.2f}x)", best >= 1.0))
    total = small["save"]["median"] + small["load"]["median"]
    rows.append(("small tensors: save + cold load well under 2 s (< 1 s, medians)",
                 f"{total:.3f} s", total < 1.0))
    return rows


def _restore_targets(results: dict) -> list[tuple[str, str, bool | None]]:
    rows = []
    restore = results.get("restore") or {}
    if len(restore) == 2:
        (base_name, base), (stream_name, stream) = restore.items()
        best, med = _ratio(base, stream, "load")
        rows.append((f"cold restore into a NumPy model: {stream_name} vs {base_name} "
                     "(informative: the overlap of assignment with reading)",
                     f"{best:.2f}x faster (median {med:.2f}x)", None))
    return rows


def _memory_targets(results: dict) -> list[tuple[str, str, bool | None]]:
    rows = []
    pm = results.get("peak_memory") or {}
    label = "peak memory added by a save <= ~10% of state"
    if "ckptcore" in pm:
        frac = pm["ckptcore"] / pm["state_bytes"]
        rows.append((label, f"{pm['ckptcore'] / 2**20:.0f} MiB = {frac:.1%} (safetensors: "
                     f"{pm['safetensors'] / pm['state_bytes']:.0%})", frac <= 0.10))
    else:
        rows.append((label, str(pm.get("error")), None))
    return rows


def _fmt_checksums(checks: dict, data_bytes: int) -> list[str]:
    lines = ["### Checksums: ckptcore with and without (back-to-back pairs)", "",
             "| where | checksums | save s (median / best) | save GB/s | load s (median / best) "
             "| load GB/s |", "|---|---|---:|---:|---:|---:|"]
    for where, c in checks.items():
        if where == "crc_alone":
            continue
        for name in ("with checksums", "without checksums"):
            s, lo = c[name]["save"], c[name]["load"]
            lines.append(f"| {where} | {name.split()[0]} | {s['median']:.3f} / {s['best']:.3f} "
                         f"| {data_bytes / s['median'] / 1e9:.2f} | {lo['median']:.3f} / "
                         f"{lo['best']:.3f} | {data_bytes / lo['median'] / 1e9:.2f} |")
    lines.append(f"\ncrc32c alone over the state, one thread: {checks['crc_alone']:.3f} s "
                 f"({data_bytes / checks['crc_alone'] / 1e9:.1f} GB/s).")
    return lines + [""]


def print_report(results: dict, meta: dict) -> str:
    data = results["large"]["raw (one file)"]["bytes"] if "large" in results else 0
    v = meta["versions"]
    label = f" ({meta['label']})" if meta.get("label") else ""
    title = f"{meta['date']}: {meta['size_mb']:g} MiB state, {meta['rounds']} round(s){label}"
    out = [f"## {title}", "",
           f"{meta['cpus']} CPUs, {meta['platform']}, Python {meta['python']}; "
           + ", ".join(f"{k} {x}" for k, x in v.items())
           + f". ckptcore threads={meta['threads']}, shard {meta['shard_mb']:g} MiB. "
           f"Cold cache by {meta['cache']}. Times: median / best of the rounds; GB/s from the "
           f"median; \"ckptcore faster\" = contender's time / ckptcore's, best rounds "
           f"(>1: ckptcore wins). "
           f"Run took {meta['runtime_s']:.0f} s.", ""]
    if "large" in results:
        out += _fmt_case(results["large"], data, f"Large state ({data / 2**20:.0f} MiB)")
    if "small" in results:
        small = results["small"]["raw (one file)"]["bytes"]
        out += _fmt_case(results["small"], small,
                         f"Small tensors ({meta['small_count']} tensors, {small / 2**20:.1f} MiB)")
    if results.get("restore"):
        out += _fmt_restore(results["restore"])
    if "checksums" in results:
        out += _fmt_checksums(results["checksums"], data)
    out += ["### Targets", "", "| target | measured | met |", "|---|---|---|"]
    for label, value, met in targets(results):
        out.append(f"| {label} | {value} | {'-' if met is None else ('yes' if met else 'NO')} |")
    text = "\n".join(out) + "\n"
    print("\n" + text)
    return text


def record(path: str, text: str) -> None:
    new = not os.path.exists(path)
    with open(path, "a") as f:
        if new:
            f.write("# Benchmark results\n\nAppended by `benchmarks/bench_save_load.py`, newest "
                    "last. See README.md in this folder for what each number means.\n\n")
        f.write(text + "\n")
