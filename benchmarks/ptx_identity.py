"""Whether a change to relaxtune's CUDA sources changed any kernel, without a GPU: the PTX of every kernel, per arch.

    python benchmarks/ptx_identity.py dump before.json            # on the commit before the change
    python benchmarks/ptx_identity.py dump after.json             # on the change
    python benchmarks/ptx_identity.py compare before.json after.json

`dump` compiles the sources of the installed package's fatbins (the gemv fatbin for sm_80 and sm_90; the flash attention
fatbin for sm_80 and sm_90a) to PTX with nvcc and the flags they are built with, and writes a digest per kernel entry
(and one for what precedes the first: the module's globals). The anonymous namespace's name carries hashes of its file
and a number that differs from run to run, so they are replaced by a placeholder first: the same code gives the same
digests, and a pure move of code between files leaves every digest as it was. `compare` lists the kernels whose PTX
differs, appeared or disappeared, and exits 1 if any did. Identical PTX means identical SASS (ptxas is deterministic),
so a refactor that passes needs no GPU run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from relaxtune.kernels import flash_attention, gemv
from relaxtune.kernels.device_code import find_nvcc

# what nvcc's names of an anonymous namespace's (or a file-local) symbol carry besides the code: hashes of the file's
# path and contents, a number that changes from run to run, and the mangled lengths that number's digits change
ANONYMOUS = re.compile(
    r"(?<=_GLOBAL__N__)[0-9a-f]+|(?<=_INTERNAL_)[0-9a-f]+|(?<=_cu_)[0-9a-f]+_\d+|(?<=_ZN)\d+(?=_GLOBAL__N__|_INTERNAL_)"
)
ENTRY = re.compile(r"\.entry (\w+)")
# (fatbin, source, nvcc flags, arches): as kernels/gemv.py and kernels/flash_attention.py build them
FATBINS = (
    ("gemv", gemv.KERNEL_SOURCE, gemv.NVCC_FLAGS, ("sm_80", "sm_90")),
    ("flash_attention", flash_attention.KERNEL_SOURCE, flash_attention.NVCC_FLAGS, ("sm_80", "sm_90a")),
)


def kernel_digests(ptx: str) -> dict[str, str]:
    """{entry name (or "<globals>"): sha1 of its PTX with the anonymous namespace's name made neutral}. nvcc writes
    the module's variables after the first entry's `// .globl` line, before its `.entry`: they count as globals."""
    out, module = {}, []
    for part in re.split(r"(?=\n\t// \.globl)", ANONYMOUS.sub("X", ptx)):
        found = ENTRY.search(part)
        if found is None:
            module.append(part)
            continue
        start = part.rfind("\n", 0, found.start()) + 1  # the line of `.entry` (after `.visible`, `.weak`)
        header, _, between = part[:start].partition("\n\t// .globl")
        marker, _, declarations = between.partition("\n")
        module.append(header + declarations)
        out[found.group(1)] = hashlib.sha1(f"// .globl{marker}\n{part[start:]}".encode()).hexdigest()
    return {"<globals>": hashlib.sha1("".join(module).encode()).hexdigest(), **out}


def dump(path: Path) -> None:
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, source, flags, arches in FATBINS:
            src = Path(tmp) / f"{name}.cu"
            src.write_text(source)
            for arch in arches:
                out = Path(tmp) / f"{name}_{arch}.ptx"
                cmd = [find_nvcc(), "--ptx", f"-arch={arch}", *flags, "-o", str(out), str(src)]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"nvcc failed on the {name} fatbin for {arch}:\n{done.stderr[-2000:]}")
                digests[f"{name}/{arch}"] = kernel_digests(out.read_text())
                print(f"{name} {arch}: {len(digests[f'{name}/{arch}']) - 1} kernels")
    path.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")


def compare(before: dict, after: dict) -> list[str]:
    """One line per kernel (fatbin/arch: name) whose PTX differs, appeared or disappeared."""
    lines = []
    for unit in sorted(set(before) | set(after)):
        a, b = before.get(unit, {}), after.get(unit, {})
        for kernel in sorted(set(a) | set(b)):
            if kernel not in a:
                lines.append(f"{unit}: {kernel} is new")
            elif kernel not in b:
                lines.append(f"{unit}: {kernel} is gone")
            elif a[kernel] != b[kernel]:
                lines.append(f"{unit}: {kernel} differs")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("dump").add_argument("out", type=Path)
    both = sub.add_parser("compare")
    both.add_argument("before", type=Path)
    both.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "dump":
        dump(args.out)
        return
    before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
    lines = compare(before, after)
    total = sum(len(v) for v in before.values())
    print("\n".join(lines) if lines else f"every kernel's PTX identical ({total} entries over {len(before)} units)")
    sys.exit(1 if lines else 0)


if __name__ == "__main__":
    main()
