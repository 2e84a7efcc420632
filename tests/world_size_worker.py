"""The ranks of the world-size tests (tests/test_world_sizes.py), on the CPU (gloo):

    python tests/world_size_worker.py OUT TRAIN_GLOB VAL_GLOB OVERRIDES_JSON W [W ...]

For each world size W in turn, this process forks W ranks and waits for them: each rank gets the environment
torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so train_gpt.setup_distributed starts
the gloo process group as under torchrun. Forked ranks share the one import of torch and the trainer (seconds of
CPU each, and 1 + 2 + 4 + 8 ranks share 2 cores in CI); the torchrun launch itself is tested by
records/world_sizes.py's test. Each rank builds the smoke Trainer (OVERRIDES_JSON: Hyperparameters fields), runs
step 0, step 1 and the untie step (three optimizer steps; the third unties the embedding from the LM head) and a
validation, and writes OUT/wsW/rank<r>.pt with what the test compares across ranks and world sizes:

* ``grads[s][j][name]``: the gradient of every parameter in micro-step j of step s, as the autograd hook on the
  parameter sees it (complete, before the optimizer's post-accumulate hook folds it into its accumulator);
* ``reduced[s][name]``: the rows this rank received from each reduce-scatter (``train_gpt.reduce_scatter_sum``),
  and ``contents[s][name]``: the parameters whose gradients that buffer sums (while tied, the LM head's holds the
  embedding's too);
* ``events``: in program order, ``("grad", s, j, name)`` when a gradient is complete, ``("rs", s, j, name)``
  when its reduce-scatter is launched, ``("backward_end", s, j)`` when ``loss.backward()`` returns, and
  ``("collective", op, shape, dtype)`` for every torch.distributed call of the trainer;
* ``masters``: each group's optimizer shard (fp32 rows) as the optimizer built it, before any step;
* the train losses, the validation loss (and its number of micro-batches), the initial and final parameters.

World size 1's order. After recording what the reduce-scatter returned, the rows are overwritten with the sum
world size 1 computes: the 8 micro-gradients (gathered from the ranks) added one by one in slot order in fp32,
as its accumulator does (while tied, the embedding's sum transposed into the head's). The order of that sum
is the only thing a world size changes in the math; with it fixed, every world size must follow world size
1's steps bit for bit, which the test checks. Without it, no bound on the parameters would both hold and
catch a bug: Adam's first update is lr * g / (|g| + eps), the sign of g, and a gradient that cancels to
below the rounding of its sum takes either sign in another order (tests/tolerances.py, rule 4). What the
reduce-scatter returned is checked separately, against the exact sum (rule 4).
"""
import json
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (the forward's mark_dynamic imports it: once here, not in every forked rank)
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402  (after the path)
from data.shards import shard_files  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
               "barrier")


def main(out, train, val, overrides):
    d = tg.setup_distributed()
    hp = tg.smoke_hyperparameters(train_files=train, val_files=val, **overrides)
    tr = tg.Trainer(hp, d, shard_files(hp.train_files), shard_files(hp.val_files))
    opt = tr.opt
    events, grads, reduced, contents = [], [], [], []
    at = {"step": None, "micro": 0, "recording": True}

    # Gradient hooks: a tensor hook on a leaf runs when its gradient is complete, before the optimizer's
    # post-accumulate-grad hook (which folds it into the accumulator and may launch the reduce-scatter).
    for name, g in opt.groups.items():
        def on_grad(grad, name=name):
            events.append(("grad", at["step"], at["micro"], name))
            grads[-1][at["micro"]][name] = grad.detach().float().clone()
        g.param.register_hook(on_grad)

    backward = torch.Tensor.backward

    def backward_and_mark(self, *args, **kwargs):
        backward(self, *args, **kwargs)
        events.append(("backward_end", at["step"], at["micro"]))
        at["micro"] += 1
    torch.Tensor.backward = backward_and_mark

    for op in COLLECTIVES:
        def record(*args, _op=op, _fn=getattr(dist, op), **kwargs):
            if at["recording"]:
                t = args[1] if args and isinstance(args[0], list) else next(
                    (a for a in args if isinstance(a, torch.Tensor)), None)
                events.append(("collective", _op, None if t is None else tuple(t.shape),
                               None if t is None else str(t.dtype)))
            return _fn(*args, **kwargs)
        setattr(dist, op, record)

    def slot_sum(name):
        """World size 1's accumulator of `name` for this step: its 8 micro-gradients added in slot order, fp32 (zero
        for a parameter no backward reaches: --xsa's alpha without --xsa)."""
        zero = torch.zeros(opt.groups[name].param.shape, dtype=torch.float32, device=d.device)
        mine = torch.stack([micro.get(name, zero) for micro in grads[-1]])
        parts = [torch.empty_like(mine) for _ in range(d.world)]
        at["recording"] = False  # the test's own collectives are not the trainer's
        if d.world > 1:
            dist.all_gather(parts, mine)
        else:
            parts[0].copy_(mine)
        at["recording"] = True
        acc = torch.zeros_like(mine[0])
        for slot in range(tg.SLOTS):  # rank r holds slots r, r + W, ...
            acc += parts[slot % d.world][slot // d.world]
        return acc

    names = {g.acc.data_ptr(): n for n, g in opt.groups.items()}
    reduce_scatter_sum = tg.reduce_scatter_sum

    def reduce_scatter_in_world_size_1_order(dd, full):
        name = names[full.data_ptr()]
        events.append(("rs", at["step"], at["micro"], name))
        work, shard = reduce_scatter_sum(dd, full)
        if work is not None:
            work.wait()
        reduced[-1][name] = shard.clone()
        ws1 = slot_sum(name)
        contents[-1][name] = (name,)
        if name == "lm_head" and opt.tied:  # the embedding's sum folded into the head's, one fp32 add
            ws1 += slot_sum("embed").T
            contents[-1][name] += ("embed",)
        full.zero_()
        full[:len(ws1)] = ws1
        rows = full.shape[0] // dd.world  # the shard reduce_scatter_sum returns
        return None, full[dd.rank * rows:(dd.rank + 1) * rows]
    tg.reduce_scatter_sum = reduce_scatter_in_world_size_1_order

    masters = {n: g.master.clone() for n, g in opt.groups.items()}
    steps = (0, 1, tg.untie_step(hp))
    losses = []
    for s, step in enumerate(steps):
        at["step"], at["micro"] = s, 0
        grads.append([{} for _ in range(tr.accum)])
        reduced.append({})
        contents.append({})
        losses.append(tr.train_step(step, want_loss=True))
    tr.loader.close()
    at["step"] = "val"
    val_loss = tr.validate(tg.windows_at(hp, steps[-1]))
    torch.save({"world": d.world, "rank": d.rank, "steps": steps, "losses": losses, "val_loss": val_loss,
                "val_micro": tr.val_micro, "model_dim": hp.model_dim, "events": events, "grads": grads,
                "reduced": reduced, "contents": contents, "masters": masters,
                "initial": tr.initial, "params": {k: v.detach().clone() for k, v in tr.params.items()}},
               Path(out) / f"rank{d.rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(world, out, train, val, overrides):
    """Forks the ``world`` ranks of one world size and waits for them; a rank that fails stops the others.
    Returns (rank, exit status) of the first rank that failed, or None when every rank wrote its record."""
    with socket.socket() as s:  # a free port for rank 0's store, as torchrun --standalone picks one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # the rank: its record, then out without running the parent's exit handlers
            code = 1
            try:
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                  LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                main(out, train, val, overrides)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = rank
    failed = None
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0 and failed is None:
            failed = rank, os.waitstatus_to_exitcode(status)
            for other in pids:  # the others would wait for the failed rank in their next collective
                os.kill(other, signal.SIGKILL)
    return failed


if __name__ == "__main__":
    out_dir, train_glob, val_glob, over = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    over = {k: tuple(v) if isinstance(v, list) else v for k, v in over.items()}
    for w in map(int, sys.argv[5:]):
        (Path(out_dir) / f"ws{w}").mkdir(exist_ok=True)
        failed = launch(w, Path(out_dir) / f"ws{w}", train_glob, val_glob, over)
        if failed:
            sys.exit(f"world_size_worker.py: world size {w}: rank {failed[0]} failed (exit status {failed[1]}), "
                     f"the other ranks were stopped")
