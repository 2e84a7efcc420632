"""A stack sampler for train_gpt.py's rank processes (a lab probe: PYTHONPATH=this folder). With STACK_SAMPLE_OUT
set and the process running train_gpt.py, a daemon thread reads every thread's Python stack each 20 ms until the
first `step:0/` validation has printed (or 400 s), then writes STACK_SAMPLE_OUT.rank: per thread, the frames that
were on the stack longest (inclusive seconds, file:function:line) and a timeline: each second's most frequent
innermost frame of torch, triton or this repository. Where a fresh machine's first start spends the seconds its
second start does not."""
import atexit, collections, os, re, sys, threading, time

_out = os.environ.get("STACK_SAMPLE_OUT")
if _out and sys.argv and sys.argv[0].endswith("train_gpt.py"):
    _t0, _period = time.time(), 0.02
    _samples = []  # (t, thread name, frames innermost first as (file, func, line))
    _stop = threading.Event()

    def _short(f):
        f = re.sub(r"^.*/lib/python3\.\d+/(site-packages/)?", "", f)
        return f if not f.startswith("/") else "/".join(f.rsplit("/", 2)[-2:])

    def _loop():
        me = threading.get_ident()
        while not _stop.is_set() and time.time() - _t0 < 400:
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.time() - _t0
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None and len(stack) < 60:
                    c = frame.f_code
                    stack.append((_short(c.co_filename), c.co_name, frame.f_lineno))
                    frame = frame.f_back
                _samples.append((now, names.get(ident, str(ident)), stack))
            time.sleep(_period)

    def _write():
        _stop.set()
        rank = os.environ.get("RANK", "0")
        by_thread = collections.defaultdict(list)
        for t, name, stack in _samples:
            by_thread[name].append((t, stack))
        lines = [f"stack samples: {len(_samples)} over {time.time() - _t0:.1f} s, every {_period * 1000:.0f} ms"]
        for name, rows in by_thread.items():
            if len(rows) * _period < 1.0:
                continue
            incl = collections.Counter()
            for _, stack in rows:
                seen = set()
                for f in stack:
                    k = f"{f[0]}:{f[1]}"
                    if k not in seen:
                        seen.add(k)
                        incl[k] += 1
            lines.append(f"== thread {name}: {len(rows) * _period:.1f} s sampled; inclusive seconds, top 80")
            lines += [f"{n * _period:7.2f} {k}" for k, n in incl.most_common(80)]
            lines.append(f"== thread {name}: timeline (second: innermost torch/triton/repo frame, share; caller)")
            bins = collections.defaultdict(collections.Counter)
            for t, stack in rows:
                inner = next((i for i, f in enumerate(stack)), None)
                pick = next((i for i, f in enumerate(stack) if not f[0].startswith(("threading", "concurrent",
                                                                                    "selectors", "subprocess"))), 0)
                f = stack[pick] if stack else ("?", "?", 0)
                caller = stack[pick + 1] if len(stack) > pick + 1 else ("", "", 0)
                bins[int(t)][f"{f[0]}:{f[1]}:{f[2]} < {caller[0]}:{caller[1]}"] += 1
            for s in sorted(bins):
                (k, n), total = bins[s].most_common(1)[0], sum(bins[s].values())
                lines.append(f"{s:4d} {n / total:4.0%} {k}")
        with open(f"{_out}.{rank}", "w") as fh:
            fh.write("\n".join(lines) + "\n")

    def _watch_stdout():  # stop at the step-0 validation line: wrap sys.stdout.write
        real = sys.stdout.write
        def write(s):
            if "step:0/" in s and "val_loss" in s and not _stop.is_set():
                _write()
            return real(s)
        sys.stdout.write = write

    threading.Thread(target=_loop, name="stack-sampler", daemon=True).start()
    try:
        _watch_stdout()
    except Exception:  # noqa: BLE001
        pass
    atexit.register(lambda: None if _stop.is_set() else _write())
