"""One process of a ``jax.distributed`` job for test_jax_group.py (see ``_jax_ranks.py``).

    python _jax_group_worker.py save URL     # every process saves its blocks: one commit
    python _jax_group_worker.py load URL     # every process loads its blocks (like=) and checks them
    python _jax_group_worker.py late URL     # process 1 does not come to a barrier in time
    python _jax_group_worker.py orbax DIR    # Orbax saves DIR/ocdbt and DIR/zarr3 (every process
                                             # its shards) and restores DIR/exported into the mesh

The arrays are :func:`expected` (pure functions of their shapes) laid over a mesh of every
device of the job (4 x 2: ``a`` across the processes' devices, ``b`` within).
"""

from __future__ import annotations

import json
import sys

from _jax_ranks import init

import ckptcore  # noqa: E402

SHAPES = {"w": ((8, 6), ("a", "b")), "rows": ((8, 5), ("a", None)), "bias": ((6,), (None,)),
          "odd": ((12,), ("a",))}


def expected() -> dict:
    import numpy as np

    out = {k: (np.arange(int(np.prod(s)), dtype=np.float32).reshape(s) * (i + 1) / 7)
           for i, (k, (s, _)) in enumerate(SHAPES.items())}
    out["count"] = np.asarray(5, np.int32)
    return out


def build(mesh, fill: bool = True) -> tuple[dict, dict]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    want = expected()
    arrays = {}
    for k, (shape, spec) in SHAPES.items():
        src = want[k] if fill else np.zeros(shape, np.float32)
        arrays[k] = jax.make_array_from_callback(shape, NamedSharding(mesh, P(*spec)), lambda i, s=src: s[i])
    count = want["count"] if fill else np.zeros((), np.int32)
    opt = {"mu": {"w": arrays["w"]},
           "count": jax.make_array_from_callback((), NamedSharding(mesh, P()), lambda i, c=count: c)}
    params = {k: v for k, v in arrays.items()}
    return params, opt


def main(mode: str, url: str) -> None:
    rank, world = init()
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import ckptcore_jax

    mesh = Mesh(np.array(jax.devices()).reshape(4, -1), ("a", "b"))
    group = ckptcore_jax.process_group()
    assert (group.rank, group.size) == (rank, world)
    if mode == "late":
        late(group, rank)
        return
    if mode == "orbax":
        orbax(mesh, url, rank)
        return
    if mode == "save":
        params, opt = build(mesh)
        state = ckptcore_jax.capture(ckptcore_jax.Ref(params), ckptcore_jax.Ref(opt), rng=False, step=7)
        info = ckptcore.save_state(url, state, group=group)
        print(json.dumps({"rank": rank, "step": info.step}), flush=True)
        return
    params, opt = build(mesh, fill=False)
    m, o = ckptcore_jax.Ref(params), ckptcore_jax.Ref(opt)
    state = ckptcore.load_state(url, like=ckptcore_jax.template(m, o), group=group)
    report = ckptcore_jax.restore(state, m, o)
    want = expected()
    checked = 0
    for k, arr in {**m.value, "mu": o.value["mu"]["w"], "count": o.value["count"]}.items():
        whole = want["w" if k == "mu" else k]
        assert arr.sharding == (params.get(k) if k in params else (opt["mu"]["w"] if k == "mu" else opt["count"])).sharding
        for shard in arr.addressable_shards:
            assert np.asarray(shard.data).tobytes() == whole[shard.index].tobytes(), (rank, k, shard.index)
            checked += 1
    print(json.dumps({"rank": rank, "ok": report.ok, "checked": checked, "step": state.step}), flush=True)


def orbax(mesh, folder: str, rank: int) -> None:
    """A multi-process Orbax save, OCDBT (``StandardCheckpointer``) and plain zarr3, each process
    writing the shards it holds; then ``folder/exported`` (written by ``export_orbax`` in one
    process) restored by Orbax into this job's mesh, every shard checked here."""
    import os

    import numpy as np
    import orbax.checkpoint as ocp

    params, opt = build(mesh)
    tree = {"params": params, "opt_state": opt, "step": 7}
    with ocp.StandardCheckpointer() as c:
        c.save(os.path.join(folder, "ocdbt"), tree)
        c.wait_until_finished()
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)) as c:
        c.save(os.path.join(folder, "zarr3"), args=ocp.args.PyTreeSave(tree))
    zeros, zero_opt = build(mesh, fill=False)
    with ocp.StandardCheckpointer() as c:
        restored = c.restore(os.path.join(folder, "exported"),
                             {"params": zeros, "opt_state": zero_opt, "step": 0})
    want, checked = expected(), 0
    got = {**restored["params"], "mu": restored["opt_state"]["mu"]["w"],
           "count": restored["opt_state"]["count"]}
    for k, arr in got.items():
        assert arr.sharding == (zeros.get(k, zeros["w"]) if k != "count" else zero_opt["count"]).sharding, k
        for shard in arr.addressable_shards:
            whole = want["w" if k == "mu" else k]
            assert np.asarray(shard.data).tobytes() == whole[shard.index].tobytes(), (rank, k)
            checked += 1
    print(json.dumps({"rank": rank, "checked": checked, "step": int(restored["step"])}), flush=True)


def late(group, rank: int) -> None:
    """Process 0 waits 1 s at a barrier process 1 reaches only after 4 s: a GroupTimeoutError
    on time, then the group is broken (every later call fails at once)."""
    import time

    from ckptcore.errors import GroupError, GroupTimeoutError

    if rank == 1:
        time.sleep(4)
        try:
            group.barrier(timeout=5)
        except GroupError:
            pass  # process 0 is gone from the barrier: either outcome is fine here
        print(json.dumps({"rank": rank}), flush=True)
        return
    start = time.monotonic()
    try:
        group.barrier(timeout=1)
        outcome = "returned"
    except GroupTimeoutError as e:
        outcome = f"timeout: {e}"
    waited = time.monotonic() - start
    try:
        group.gather(b"x", timeout=5)
        again = "returned"
    except GroupError as e:
        again = str(e)
    print(json.dumps({"rank": rank, "outcome": outcome, "waited": waited, "again": again}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
