import re, sys
for v in ("host", "dev", "ptr"):
    s = open(f"orig_{v}.py").read()
    m = re.search(r"@triton.jit\ndef _linear_relu2_kernel\((.*?)\n\):\n", s, re.S)
    params = m.group(1)
    names = [re.split(r"[:=]", p.strip())[0].strip() for p in re.sub(r"#[^\n]*", "", params).split(",") if p.strip()]
    s = s.replace("def _linear_relu2_kernel(", "def _linear_relu2_body(", 1)
    wrappers = ""
    for d, flag in (("fwd", "False"), ("bwd", "True")):
        ps = [n for n in names if n != "BACKWARD"]
        sig = ", ".join(n + (": tl.constexpr" if n.isupper() and len(n) > 1 else "") for n in ps)
        call = ", ".join(n if n != "BACKWARD" else flag for n in names)
        wrappers += f"\n\n@triton.jit\ndef _linear_relu2_{d}_kernel({sig}):\n    _linear_relu2_body({call})\n"
    # insert wrappers before the _epilogue helper
    i = s.index("\n\n@triton.jit\ndef _epilogue")
    s = s[:i] + wrappers + s[i:]
    s = s.replace("_linear_relu2_kernel[(progs,)](", "(_linear_relu2_bwd_kernel if backward else _linear_relu2_fwd_kernel)[(progs,)](")
    s = s.replace("NUM_PROGRAMS=progs, BACKWARD=backward,", "NUM_PROGRAMS=progs,")
    assert "BACKWARD=backward" not in s
    open(f"mlp_{v}.py", "w").write(s)
    print(v, names)
