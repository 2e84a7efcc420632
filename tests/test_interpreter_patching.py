"""tests/conftest.py's shortcut in Triton's interpreter (``_skip_the_interpreters_repeated_patching``: a
``@triton.jit`` helper called inside a launch does not swap triton.language's builtins again) changes no result
and no error: kernels whose helpers it skips give the same bits with Triton's own functions, and the helpers it
leaves to Triton (one that sees triton.language.core instead, one that sees no language module) are left to
Triton. CPU only: on a GPU nothing is interpreted."""
import importlib.util
import sys

import pytest
import torch

from tests.conftest import HAS_CUDA, INTERPRETER_SHORTCUT

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs on machines without a GPU")

if not HAS_CUDA:
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as ti

    @triton.jit
    def _twice(x):
        return x * 2.0

    @triton.jit
    def _twice_plus_root(x, y):
        return _twice(x) + tl.sqrt(y)  # a helper calling a helper, and a builtin inside a helper

    @triton.jit
    def _helpers_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        y = tl.load(y_ptr + offs, mask=mask, other=0.0)
        acc = tl.zeros((BLOCK,), tl.float32)
        for _ in tl.range(0, 3):  # tl.range and tl.sum: what the patching sets besides the builtins
            acc += _twice_plus_root(x, y)
        tl.store(out_ptr + offs, acc + tl.sum(x, axis=0), mask=mask)


def _use_tritons_own(monkeypatch):
    """Triton's interpreter functions in place of conftest's for the rest of the test."""
    for name in ("_patch_lang", "_patch_builtin", "_get_np_dtype"):
        monkeypatch.setattr(ti, name, getattr(ti, name).triton)
        assert getattr(ti, name).__module__ == ti.__name__


def _shortcut_and_triton(monkeypatch, run):
    """(run() with the shortcut, run() with Triton's own _patch_lang, _patch_builtin and _get_np_dtype); asserts
    that the first skipped some helper's patching and the second skipped none."""
    assert INTERPRETER_SHORTCUT is not None, "tests/conftest.py's shortcut is not installed"
    skipped = INTERPRETER_SHORTCUT["skipped"]
    fast = run()
    assert INTERPRETER_SHORTCUT["skipped"] > skipped, "no helper call took the shortcut: the test lost its point"
    skipped = INTERPRETER_SHORTCUT["skipped"]
    _use_tritons_own(monkeypatch)
    slow = run()
    assert INTERPRETER_SHORTCUT["skipped"] == skipped
    return fast, slow


def test_helpers_give_the_same_bits_with_and_without_the_shortcut(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    n = 37  # two programs of 32, the second ragged
    x, y = torch.randn(n, generator=gen), torch.rand(n, generator=gen)

    def run():
        out = torch.full((n,), float("nan"))
        _helpers_kernel[(2,)](x, y, out, n, BLOCK=32)
        return out

    fast, slow = _shortcut_and_triton(monkeypatch, run)
    assert torch.equal(fast, slow)
    # the specification, in float64: 3 (2 x + sqrt(y)) plus the sum of the program's x
    x64, y64 = x.double(), y.double()
    want = torch.cat([3 * (2 * x64[s] + y64[s].sqrt()) + x64[s].sum() for s in (slice(0, 32), slice(32, n))])
    torch.testing.assert_close(fast.double(), want, rtol=1e-6, atol=1e-5)


def test_project_kernels_with_helpers_give_the_same_bits(monkeypatch):
    """The cross-entropy forward and backward (helpers per tile: _softcap, _row_stats, _ce_bwd_tile, ...) and the
    embedding backward (_sequential_sums, _round, _store_rows) at small ragged shapes."""
    import kernels.cross_entropy as ce
    import kernels.embedding as emb
    gen = torch.Generator().manual_seed(1)
    N, V, C = 5, 300, 24
    x = torch.randn(N, V, generator=gen).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), generator=gen)
    w = torch.tensor([1.0, 0.5, 0.25])
    ids = torch.randint(0, 50, (40,), generator=gen)
    g = torch.randn(40, C, generator=gen).to(torch.bfloat16)

    def run():
        losses, stats = ce.softcapped_cross_entropy_fwd(x, t, w, 23.0, 5.0, 7.5)
        dx = ce.softcapped_cross_entropy_bwd(torch.full((N,), 1.0 / N), x, stats, t, w, 23.0, 5.0, 7.5)
        return losses, stats, dx, emb.embedding_backward(g, ids, 50)

    fast, slow = _shortcut_and_triton(monkeypatch, run)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def _module(tmp_path, monkeypatch, name, source):
    """A module from source in a file (the interpreter reads a helper's source through its module)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


def test_helpers_that_see_another_language_module_or_none_are_left_to_triton(tmp_path, monkeypatch):
    """A helper whose module holds triton.language.core, not triton.language (as Triton's tl.cdiv does): the launch
    did not swap that module's builtins, so Triton swaps them at the helper's first call, and the shortcut skips
    only its later calls in the launch (the second program's); core.maximum runs interpreted in both programs (the
    right values). A helper whose module holds no language module: Triton's error, as without the shortcut."""
    _module(tmp_path, monkeypatch, "ci_helper_core", "import triton\nimport triton.language.core as core\n\n\n"
            "@triton.jit\ndef at_least_half(x):\n    return core.maximum(x, 0.5)\n")
    _module(tmp_path, monkeypatch, "ci_helper_bare", "import triton\n\n\n@triton.jit\ndef plus_one(x):\n"
            "    return x + 1.0\n")
    kernels = _module(tmp_path, monkeypatch, "ci_helper_kernels", (
        "import triton\nimport triton.language as tl\nfrom ci_helper_core import at_least_half\n"
        "from ci_helper_bare import plus_one\n\n\n"
        "@triton.jit\ndef core_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):\n"
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
        "    tl.store(out_ptr + offs, at_least_half(tl.load(x_ptr + offs)))\n\n\n"
        "@triton.jit\ndef bare_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):\n"
        "    offs = tl.arange(0, BLOCK)\n    tl.store(out_ptr + offs, plus_one(tl.load(x_ptr + offs)))\n"))
    x = torch.linspace(-1, 1, 32)

    def run():
        out = torch.full((32,), float("nan"))
        kernels.core_kernel[(2,)](x, out, BLOCK=16)
        with pytest.raises(Exception) as error:
            kernels.bare_kernel[(1,)](x, torch.empty(16), BLOCK=16)
        return out, f"{error.type.__name__}: {error.value}"

    assert INTERPRETER_SHORTCUT is not None, "tests/conftest.py's shortcut is not installed"
    skipped, left = INTERPRETER_SHORTCUT["skipped"], INTERPRETER_SHORTCUT["triton"]
    out, error = run()
    assert (INTERPRETER_SHORTCUT["skipped"] - skipped, INTERPRETER_SHORTCUT["triton"] - left) == (1, 2)
    assert torch.equal(out, torch.clamp(x, min=0.5))
    assert "triton.language must be visible" in error, error
    _use_tritons_own(monkeypatch)
    out_triton, error_triton = run()
    assert torch.equal(out_triton, out) and error_triton == error
