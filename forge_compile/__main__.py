"""The command line: ``python -m forge_compile demo | explain | diff | memory``."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "demo": "train a small transformer with forge and with Inductor, side by side",
        "explain": "run SCRIPT.py [args] with dumps on and print what forge fused, at exit",
        "diff": "show DUMP_DIR's graphs before and after forge's rewrite, side by side (and as HTML)",
        "memory": "plot CUDA memory over SCRIPT.py [args], fused vs unfused, as a PNG",
    }
    if argv and argv[0] == "_memory_child":  # the measured process of `memory`
        from .debug_commands import _memory_child

        return _memory_child(argv[1:])
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: python -m forge_compile COMMAND [options]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:10} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "demo":
        from .demo import main as demo

        return demo(argv[1:])
    from . import debug_commands

    return {"explain": debug_commands.explain_script, "diff": debug_commands.diff,
            "memory": debug_commands.memory}[argv[0]](argv[1:])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
