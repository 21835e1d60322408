"""The command line: ``python -m forge_compile demo``."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "train a small transformer with forge and with Inductor, side by side"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: python -m forge_compile COMMAND [options]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:10} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "demo":
        from .demo import main as demo

        return demo(argv[1:])
    return 2


if __name__ == "__main__":
    sys.exit(main())
