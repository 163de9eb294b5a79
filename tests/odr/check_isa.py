#!/usr/bin/python3
"""Checks that compiled code uses no instruction beyond what may run where it runs.

Usage: check_isa.py FILE [--skip SUBSTRING ...] [--expect-kernels]

Disassembles FILE (objdump -d -C) and classifies every function by its name:
  - a name containing a --skip substring: not checked (the -march=native TU's own code, e.g.
                          its kvevict namespace v0_x...: checked first);
  - ...::isa_avx512::...  kvevict's AVX-512 kernel set (and its AVX512_BF16 and AMX regions):
                          runs only after the CPU check, anything goes;
  - ...::isa_avx2::...    kvevict's AVX2 kernel set: AVX2, FMA, F16C, BMI1/2, LZCNT, POPCNT,
                          nothing of AVX-512 (no zmm, no mask registers, no EVEX-only forms);
  - everything else:      the x86-64 baseline (SSE2): no VEX/EVEX instruction, no ymm/zmm/k
                          register, nothing from SSE3, SSSE3, SSE4.1/4.2, POPCNT, LZCNT, BMI,
                          MOVBE or AMX. TZCNT is allowed: compilers emit `rep bsf` for
                          __builtin_ctz on purpose, which runs as BSF on older CPUs.
Prints each violation and a summary; exits 1 on any violation. --expect-kernels also
requires both kernel sets to be present and really compiled for their targets (ymm in the
AVX2 set, zmm in the AVX-512 set), so that a build which silently lost them fails.
"""
import re
import subprocess
import sys

BASELINE_EXTRA = set("""
addsubps addsubpd haddps haddpd hsubps hsubpd movddup movshdup movsldup lddqu monitor mwait
pshufb palignr phaddw phaddd phaddsw phsubw phsubd phsubsw pabsb pabsw pabsd psignb psignw psignd
pmaddubsw pmulhrsw
blendps blendpd blendvps blendvpd pblendw pblendvb dpps dppd extractps insertps movntdqa mpsadbw
packusdw pcmpeqq pextrb pextrd pextrq pinsrb pinsrd pinsrq phminposuw pminsb pminsd pminuw pminud
pmaxsb pmaxsd pmaxuw pmaxud pmuldq pmulld ptest roundps roundpd roundss roundsd
pcmpgtq pcmpestri pcmpestrm pcmpistri pcmpistrm crc32b crc32w crc32l crc32q crc32
popcnt popcntw popcntl popcntq lzcnt lzcntw lzcntl lzcntq
andn bextr blsi blsmsk blsr bzhi mulx pdep pext rorx sarx shlx shrx
movbe movbew movbel movbeq adcx adox ldtilecfg sttilecfg
""".split())
BASELINE_EXTRA_RE = re.compile(r"^(pmov[sz]x|fisttp|tile)")
WIDE_REGS = re.compile(r"%[yz]mm\d+|%k[0-7]\b|%xmm(1[6-9]|2\d|3[01])\b")
AVX512_REGS = re.compile(r"%zmm\d+|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b|\{1to\d+\}|\{%k")
AVX512_ONLY = re.compile(
    r"^(vpternlog|vpermt2|vpermi2|vpcompress|vcompressp|vpexpand|vexpandp|vrndscale|vscalef|vgetexp|vgetmant|"
    r"vfixupimm|vrange|vreduce|vpmov(u?s)?(db|dw|qb|qw|qd|wb)\b|vpmullq|vpmaxsq|vpmaxuq|vpminsq|vpminuq|vpabsq|"
    r"vpsraq|vprol|vpror|vpopcnt|vpmadd52|vcvt\w*qq|vcvt\w*udq|vcvtudq|vcvtusi|vdpbf16ps|vcvtne2?ps2bf16|vpdpbusd|"
    r"vpdpwssd|vpshufbitqmb|vpconflict|vplzcnt|vpcmpu?[bwdq]\b|vpbroadcastm|vpmovm2|vpmov[bwdq]2m|vpermb|vpermw|"
    r"vpmultishiftqb|vpshl|vpshr|vextract[fi](32|64)x|vinsert[fi](32|64)x|vshuf[fi](32|64)x|"
    r"vbroadcast[fi](32|64)x|valign[dq]|vblendm|vpblendm|vmovdq[au](8|16|32|64)|vp(and|andn|or|xor)[dq]\b|"
    r"vpsrav[wq]|vpsllvw|vpsrlvw|vfpclass|vrcp14|vrsqrt14|tile|ldtilecfg|k[a-z]+)")
AVX2_EXTRA_FORBIDDEN = {"movbe", "movbew", "movbel", "movbeq"}


def classify(name, skips):
    if any(s in name for s in skips):
        return "skip"
    if "::isa_avx512::" in name:
        return "avx512"
    if "::isa_avx2::" in name:
        return "avx2"
    return "baseline"


def violation(kind, mnemonic, operands):
    if kind == "baseline":
        if WIDE_REGS.search(operands):
            return "needs AVX (ymm/zmm/mask registers)"
        if mnemonic.startswith("v") and mnemonic not in ("verr", "verw"):
            return "VEX/EVEX-encoded (AVX or later)"
        if mnemonic in BASELINE_EXTRA or BASELINE_EXTRA_RE.match(mnemonic):
            return "beyond SSE2 (SSE3/SSSE3/SSE4, POPCNT, LZCNT, BMI, MOVBE or AMX)"
        return None
    if kind == "avx2":
        if AVX512_REGS.search(operands):
            return "AVX-512 register or EVEX form in the AVX2 kernel set"
        if AVX512_ONLY.match(mnemonic):
            return "AVX-512/AMX-only instruction in the AVX2 kernel set"
        if mnemonic in AVX2_EXTRA_FORBIDDEN:
            return "MOVBE is not part of the AVX2 target"
    return None


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return 2
    path, skips, expect = args[0], [], False
    i = 1
    while i < len(args):
        if args[i] == "--skip" and i + 1 < len(args):
            skips.append(args[i + 1])
            i += 2
        elif args[i] == "--expect-kernels":
            expect = True
            i += 1
        else:
            print("unknown argument " + args[i])
            return 2
    dump = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", path], check=True, capture_output=True,
                          text=True).stdout
    header = re.compile(r"^[0-9a-f]+ <(.*)>:$")
    insn = re.compile(r"^\s+[0-9a-f]+:\s+(\S+)\s*(.*)$")
    counts = {"baseline": 0, "avx2": 0, "avx512": 0, "skip": 0}
    wide = {"avx2": 0, "avx512": 0}
    bad = []
    kind, name = "baseline", ""
    for line in dump.splitlines():
        m = header.match(line)
        if m:
            name = m.group(1)
            kind = classify(name, skips)
            counts[kind] += 1
            continue
        m = insn.match(line)
        if not m or kind in ("skip",):
            continue
        mnemonic, operands = m.group(1), m.group(2)
        if mnemonic in ("rep", "repz", "repnz", "lock", "notrack", "bnd", "data16", "cs", "ds") and operands:
            parts = operands.split(None, 1)
            mnemonic, operands = parts[0], parts[1] if len(parts) > 1 else ""
        if kind == "avx2" and "%ymm" in operands:
            wide["avx2"] += 1
        if kind == "avx512" and "%zmm" in operands:
            wide["avx512"] += 1
        why = violation(kind, mnemonic, operands)
        if why:
            bad.append("%s: %s: %s %s" % (why, name, mnemonic, operands))
    for b in bad[:40]:
        print("  " + b)
    if len(bad) > 40:
        print("  ... and %d more" % (len(bad) - 40))
    print("%s: %d baseline functions, %d AVX2-kernel functions (%d ymm instructions), %d AVX-512-kernel functions "
          "(%d zmm instructions), %d skipped: %s" %
          (path, counts["baseline"], counts["avx2"], wide["avx2"], counts["avx512"], wide["avx512"], counts["skip"],
           "%d VIOLATIONS" % len(bad) if bad else "clean"))
    if expect and (wide["avx2"] == 0 or wide["avx512"] == 0):
        print("FAIL: the AVX2 and AVX-512 kernel sets are missing or not compiled for their targets")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
