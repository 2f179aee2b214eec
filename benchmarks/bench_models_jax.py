"""JAX models on 8 CPU devices: ckptcore against Orbax's StandardCheckpointer (issue 26 point 6).

Two training states, defined here (no downloads), as parameter pytrees with ``optax.adamw``
after one step (so ``count``, ``mu`` and ``nu`` exist and differ from their initial values),
placed on 8 CPU devices (``--xla_force_host_platform_device_count=8``, set before JAX is
imported): every array of at least 1 MiB is sharded over a 1-D mesh of the 8 devices (along its
first dimension divisible by 8), the rest replicated; the AdamW moments have their parameter's
sharding.

* ``resnet50``: a pytree with the shapes and names of a Flax ResNet-50 (v1.5, NHWC kernels):
  ``params`` (25.6M parameters: convolutions, BatchNorm scale/bias, the 1000-way head) and
  ``batch_stats`` (BatchNorm means and variances), AdamW over ``params``: ~480 arrays, most of
  them small: the per-array cost decides it.  (A pytree rather than an NNX module: building and
  stepping NNX's ResNet-50 on 2 cores costs more than the whole benchmark; what is saved is the
  same arrays.)
* ``gpt2``: a GPT-2-small-sized decoder's parameters (12 layers, d=768, vocab 50257, context
  1024; 124.4M parameters), AdamW: 1.4 GiB, the bytes decide it.

Contenders, in interleaved rounds (the order alternates; ``--warmup`` rounds not counted), each
saving into a fresh path (the previous output deleted and the deletion synced):

* ckptcore: ``save_state(dir, model=Ref(tree), optimizer=Ref(opt_state))`` through the JAX
  adapter (it fsyncs its files) / ``load_state(dir, model=Ref(target), optimizer=Ref(target_opt),
  like=ckptcore_jax.template(...))``: each device's blocks read into arrays with the target's
  shardings, every checksum verified;
* Orbax: ``ocp.StandardCheckpointer().save(path, {"model": tree, "opt": opt_state})`` +
  ``wait_until_finished()`` + an fsync of its files (TensorStore fsyncs the array data it writes;
  the metadata files Orbax writes from Python it does not, so they are fsynced here, in Orbax's
  time) / ``restore(path, target)`` with ``target`` the ``jax.ShapeDtypeStruct``s of the restore
  target, carrying its shardings.

Restores are timed until every array is ready (``jax.block_until_ready``) and checked bit for
bit against the saved arrays, shard by shard, with the target's sharding; the target holds other
values, so every restore has everything to put back.  **Warm** restores run right after the save
(files in the page cache: the libraries' own cost; the target); **cold** ones after ``fsync`` +
``posix_fadvise(DONTNEED)`` on the files (informative: mostly the disk).

**Async**: ``CheckpointManager(root, async_save=True, keep=1).save(step, model=, optimizer=)``
against ``StandardCheckpointer.save`` (async: it returns once the arrays are copied to host
memory): the time until the call returns (the caller is blocked that long; the target) and until
the save is durable (``handle.result()`` / ``wait_until_finished()`` + the fsync above), one save
in flight at a time; Orbax's previous step is deleted outside its time, as the manager's
``keep=1`` does in the background.

Targets (issue 26): save >= 1.2x Orbax's speed, warm restore >= 1.2x, async blocking time <=
Orbax's.  Ratios are Orbax's median time over ckptcore's (> 1: ckptcore faster).

    python benchmarks/bench_models_jax.py            # both models, 3 rounds + 1 warm-up (~4 minutes on 2 cores)
    python benchmarks/bench_models_jax.py --quick    # reduced models, 2 rounds, nothing recorded
"""

from __future__ import annotations

import os

# Eight CPU devices, before JAX is imported (by anything).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "adapters"))
warnings.filterwarnings("ignore")
logging.getLogger("ckptcore").setLevel(logging.WARNING)  # the manager logs each retention deletion
logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs every step of every save

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_jax  # noqa: E402
from _common import clean, evict, files_under, fsync_paths, summary, timed, cell  # noqa: E402

MODELS = ("resnet50", "gpt2")
NAMES = {"ck": "ckptcore", "ob": "Orbax"}
TARGETS = {"save": 1.2, "warm": 1.2, "block": 1.0}  # Orbax's time over ckptcore's, at least
SHARD_MIN_BYTES = 2**20


# ---------------------------------------------------------------------------------------- models
def resnet50_shapes(width: int = 64) -> dict:
    """Flax ResNet-50 (v1.5) names and shapes: {"params": ..., "batch_stats": ...}."""
    params: dict = {}
    stats: dict = {}

    def bn(name: str, c: int) -> None:
        params[name] = {"scale": (c,), "bias": (c,)}
        stats[name] = {"mean": (c,), "var": (c,)}

    params["conv_init"] = {"kernel": (7, 7, 3, width)}
    bn("bn_init", width)
    cin = width
    for s, blocks in enumerate((3, 4, 6, 3)):
        f = width * 2**s
        for b in range(blocks):
            name = f"BottleneckResNetBlock_{sum((3, 4, 6, 3)[:s]) + b}"
            p, st = {}, {}
            params[name], stats[name] = p, st
            for i, shape in enumerate(((1, 1, cin, f), (3, 3, f, f), (1, 1, f, 4 * f))):
                p[f"Conv_{i}"] = {"kernel": shape}
                c = shape[-1]
                p[f"BatchNorm_{i}"] = {"scale": (c,), "bias": (c,)}
                st[f"BatchNorm_{i}"] = {"mean": (c,), "var": (c,)}
            if b == 0:
                p["conv_proj"] = {"kernel": (1, 1, cin, 4 * f)}
                p["norm_proj"] = {"scale": (4 * f,), "bias": (4 * f,)}
                st["norm_proj"] = {"mean": (4 * f,), "var": (4 * f,)}
            cin = 4 * f
    params["Dense_0"] = {"kernel": (cin, 1000), "bias": (1000,)}
    return {"params": params, "batch_stats": stats}


def gpt2_shapes(layers: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> dict:
    """GPT-2 (Flax/HF layout, LM head tied to ``wte``): 124.4M parameters at the defaults."""
    params: dict = {"wte": {"embedding": (vocab, d)}, "wpe": {"embedding": (ctx, d)},
                    "ln_f": {"scale": (d,), "bias": (d,)}}
    for i in range(layers):
        params[f"h_{i}"] = {
            "ln_1": {"scale": (d,), "bias": (d,)},
            "attn": {"c_attn": {"kernel": (d, 3 * d), "bias": (3 * d,)},
                     "c_proj": {"kernel": (d, d), "bias": (d,)}},
            "ln_2": {"scale": (d,), "bias": (d,)},
            "mlp": {"c_fc": {"kernel": (d, 4 * d), "bias": (4 * d,)},
                    "c_proj": {"kernel": (4 * d, d), "bias": (d,)}}}
    return {"params": params}


def shapes_of(name: str, quick: bool) -> dict:
    if name == "resnet50":
        return resnet50_shapes(16 if quick else 64)
    return gpt2_shapes(2, 256, 8192, 256) if quick else gpt2_shapes()


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def sharding_for(shape: tuple, dtype, mesh: Mesh) -> NamedSharding:
    """Shard arrays of at least 1 MiB along their first dimension divisible by the mesh."""
    n = mesh.devices.size
    if int(np.prod(shape)) * np.dtype(dtype).itemsize >= SHARD_MIN_BYTES:
        for i, s in enumerate(shape):
            if s % n == 0:
                return NamedSharding(mesh, P(*([None] * i + ["x"])))
    return NamedSharding(mesh, P())


def place(tree, mesh: Mesh):
    """Every leaf device_put with :func:`sharding_for` (explicit, so source and target agree)."""
    return jax.tree.map(lambda a: jax.device_put(a, sharding_for(a.shape, a.dtype, mesh)), tree)


def build(name: str, seed: int, mesh: Mesh, quick: bool):
    """(model tree, AdamW state) after one step, on ``mesh``; different values per seed."""
    rng = np.random.default_rng(seed)
    shapes = shapes_of(name, quick)

    def init(shape):
        return (rng.standard_normal(size=shape, dtype=np.float32) * 0.02).astype(np.float32)

    tree = place(jax.tree.map(init, shapes, is_leaf=_is_shape), mesh)
    tx = optax.adamw(1e-3, weight_decay=0.01)

    @jax.jit
    def step(params):
        grads = jax.tree.map(lambda p: p * 0.5 + 1e-3, params)
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, opt_state = step({"params": tree["params"]})
    tree = dict(tree, params=params["params"])
    return place(tree, mesh), place(opt_state, mesh)


def leaves(tree) -> list:
    return jax.tree.leaves(tree)


def state_bytes(tree, opt) -> int:
    return sum(a.size * a.dtype.itemsize for a in leaves((tree, opt)))


def same(a, b) -> str | None:
    """None when ``b`` equals ``a`` bit for bit, shard by shard, with the same shardings; else
    where they differ."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return "tree structure"
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), leaves(b)):
        where = jax.tree_util.keystr(path)
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{where}: shape/dtype"
        if not x.sharding.is_equivalent_to(y.sharding, x.ndim):
            return f"{where}: sharding {y.sharding} (want {x.sharding})"
        xs = sorted(x.addressable_shards, key=lambda s: s.device.id)
        ys = sorted(y.addressable_shards, key=lambda s: s.device.id)
        for s, t in zip(xs, ys):
            if s.index != t.index or np.asarray(s.data).tobytes() != np.asarray(t.data).tobytes():
                return f"{where}: values on {s.device}"
    return None


# ---------------------------------------------------------------------------------------- contenders
class Contenders:
    def __init__(self, root: str, src: tuple, dst: tuple):
        self.src, self.dst = src, dst
        self.paths = {"ck": os.path.join(root, "ckptcore"), "ob": os.path.join(root, "orbax")}
        self.ckptr = ocp.StandardCheckpointer()
        self.abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            {"model": dst[0], "opt": dst[1]})
        self.restored: tuple | None = None

    def save(self, n: str) -> None:
        if n == "ck":
            ckptcore.save_state(self.paths["ck"], model=ckptcore_jax.Ref(self.src[0]),
                                optimizer=ckptcore_jax.Ref(self.src[1]))
        else:
            self.ckptr.save(self.paths["ob"], {"model": self.src[0], "opt": self.src[1]})
            self.ckptr.wait_until_finished()
            fsync_paths([self.paths["ob"]])  # TensorStore fsynced the array data, not the metadata

    def load(self, n: str) -> None:
        if n == "ck":
            m, o = ckptcore_jax.Ref(self.dst[0]), ckptcore_jax.Ref(self.dst[1])
            ckptcore.load_state(self.paths["ck"], model=m, optimizer=o, like=ckptcore_jax.template(m, o))
            got = (m.value, o.value)
        else:
            r = self.ckptr.restore(self.paths["ob"], self.abstract)
            got = (r["model"], r["opt"])
        self.restored = jax.block_until_ready(got)

    def check(self, label: str) -> None:
        bad = same(self.src, self.restored)
        self.restored = None
        if bad is not None:
            raise AssertionError(f"{label}: the restored state differs from the saved one at {bad}")

    def close(self) -> None:
        self.ckptr.close()



def sync_rounds(name: str, src: tuple, dst: tuple, args) -> dict:
    names = ["ck", "ob"]
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        c = Contenders(root, src, dst)
        for r in range(args.warmup + args.rounds):
            got = {}
            k = r % len(names)
            for n in names[k:] + names[:k]:  # rotate who goes first
                clean(c.paths[n])
                got[f"{n}_save"] = timed(lambda: c.save(n))
                got[f"{n}_warm"] = timed(lambda: c.load(n))
                c.check(f"{name}: {NAMES[n]} warm restore")
                evict([c.paths[n]], "fadvise")
                got[f"{n}_cold"] = timed(lambda: c.load(n))
                c.check(f"{name}: {NAMES[n]} cold restore")
            print(f"  {name} round {r}{' (warm-up)' if r < args.warmup else ''}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
            if r >= args.warmup:
                for k, v in got.items():
                    times.setdefault(k, []).append(v)
        sizes = {n: sum(os.path.getsize(f) for f in files_under([c.paths[n]])) for n in names}
        c.close()
    return {"times": times, "sizes": sizes}


def async_rounds(name: str, src: tuple, args) -> dict:
    """Blocking and total time of an async save: ckptcore's manager against Orbax's checkpointer."""
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        mgr = ckptcore.CheckpointManager(os.path.join(root, "ck"), async_save=True, keep=1)
        ckptr = ocp.StandardCheckpointer()
        ob_prev = None
        for r in range(args.warmup + args.rounds):
            got = {}
            for n in (["ck", "ob"] if r % 2 == 0 else ["ob", "ck"]):
                t0 = time.perf_counter()
                if n == "ck":
                    handle = mgr.save(r + 1, model=ckptcore_jax.Ref(src[0]), optimizer=ckptcore_jax.Ref(src[1]))
                    got["ck_block"] = time.perf_counter() - t0
                    handle.result()
                else:
                    path = os.path.join(root, f"orbax-{r + 1}")
                    ckptr.save(path, {"model": src[0], "opt": src[1]})
                    got["ob_block"] = time.perf_counter() - t0
                    ckptr.wait_until_finished()
                    fsync_paths([path])
                got[f"{n}_total"] = time.perf_counter() - t0
                if n == "ob":  # retention for Orbax too, outside its time
                    if ob_prev:
                        clean(ob_prev)
                    ob_prev = path
            print(f"  {name} async round {r}{' (warm-up)' if r < args.warmup else ''}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
            if r >= args.warmup:
                for k, v in got.items():
                    times.setdefault(k, []).append(v)
        mgr.close()
        ckptr.close()
    return {"times": times}


# ---------------------------------------------------------------------------------------- report

ROWS = [  # label, operation key, target (Orbax's time over ckptcore's, at least)
    ("save + fsync (until durable)", "save", TARGETS["save"]),
    ("restore into the target shardings, page cache warm", "warm", TARGETS["warm"]),
    ("restore, cold (informative)", "cold", None),
    ("async save: caller blocked", "block", TARGETS["block"]),
    ("async save: until durable (informative)", "total", None),
]


def report(results: dict, args) -> list[str]:
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"## JAX models on 8 CPU devices: ckptcore vs Orbax StandardCheckpointer "
             f"({now:%Y-%m-%d %H:%M} UTC)" + (f" - {args.label}" if args.label else ""), "",
             f"jax {jax.__version__}, orbax-checkpoint {ocp.__version__}, optax {optax.__version__}, "
             f"numpy {np.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
             f"{len(jax.devices())} JAX CPU devices (a 1-D mesh; arrays >= 1 MiB sharded 8 ways, the "
             f"rest replicated); AdamW after one step; {args.rounds} interleaved rounds after "
             f"{args.warmup} discarded; times in seconds as median [best-worst]; ratios are Orbax's "
             "median over ckptcore's (> 1: ckptcore faster). Saves until durable: ckptcore fsyncs "
             "itself; Orbax's TensorStore fsyncs the array data but not Orbax's metadata files, which "
             "are fsynced after wait_until_finished(), in Orbax's time. Restores into arrays with the "
             "target's shardings (ckptcore: load_state(like=ckptcore_jax.template(...)); Orbax: "
             "restore(path, ShapeDtypeStructs with the shardings)), timed until ready, cold ones after "
             "fadvise DONTNEED on the files; every restore checked bit for bit, shard by shard. "
             f"Load average (1 min) at the start and end of the run: {args.load_start:.1f}, "
             f"{os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs; other work on the machine shows here).", ""]
    lines += ["| model | operation | ckptcore | Orbax | vs Orbax | target |", "|---|---|---:|---:|---:|---|"]
    verdicts: list[str] = []
    for name, res in results.items():
        t = {k: summary(v) for k, v in res["times"].items()}
        for label, op, need in ROWS:
            if f"ck_{op}" not in t:
                continue
            ratio = t[f"ob_{op}"]["median"] / t[f"ck_{op}"]["median"]
            met = "-"
            if need is not None:
                ok = ratio >= need
                want = "<= Orbax's time" if op == "block" else f">= {need:g}x"
                met = f"{want}: {'PASS' if ok else 'FAIL'}"
                verdicts.append(f"{name} {label} vs Orbax: {ratio:.2f}x (target {want}) {'PASS' if ok else 'FAIL'}")
            lines.append(f"| {name} | {label} | {cell(t[f'ck_{op}'])} | {cell(t[f'ob_{op}'])} | "
                         f"{ratio:.2f}x | {met} |")
    lines.append("")
    for name, res in results.items():
        mib = {n: s / 2**20 for n, s in res["sizes"].items()}
        lines.append(f"{name}: {res['params'] / 1e6:.1f}M parameters, {res['arrays']} arrays (model + "
                     f"AdamW state), {res['sharded']} of them sharded, {res['bytes'] / 2**20:.0f} MiB; files "
                     f"{mib['ck']:.0f} / {mib['ob']:.0f} MiB (ckptcore / Orbax).")
    lines += ["", "Verdicts: " + "; ".join(verdicts) + ".", ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: resnet50,gpt2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder under $TMPDIR)")
    ap.add_argument("--quick", action="store_true", help="reduced models, 2 rounds, not recorded")
    ap.add_argument("--no-async", action="store_true", help="skip the async comparison")
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--label", default="", help="added to the recorded section's title")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.no_record = min(args.rounds, 2), 1, True
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r} (known: {', '.join(MODELS)})")
    if len(jax.devices()) < 8:
        sys.exit(f"needs 8 JAX devices, got {len(jax.devices())} (XLA_FLAGS was set too late?)")
    args.load_start = os.getloadavg()[0]
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    results = {}
    for name in models:  # one model at a time: GPT-2 with AdamW is 1.4 GiB a copy
        print(f"== {name}{' (quick: reduced size)' if args.quick else ''}", flush=True)
        src, dst = build(name, 0, mesh, args.quick), build(name, 1, mesh, args.quick)
        res = sync_rounds(name, src, dst, args)
        if not args.no_async:
            res["times"].update(async_rounds(name, src, args)["times"])
        all_leaves = leaves(src)
        res.update(bytes=state_bytes(*src), arrays=len(all_leaves),
                   sharded=sum(1 for a in all_leaves if not a.sharding.is_fully_replicated),
                   params=sum(a.size for a in leaves(src[0]["params"])))
        results[name] = res
        del src, dst
    lines = report(results, args)
    print("\n" + "\n".join(lines))
    if not args.no_record:
        from _report import record
        record(args.results, "\n".join(lines))


if __name__ == "__main__":
    main()
