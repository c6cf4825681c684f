"""Run the kvbridge benchmarks: same as `kvbridge bench` (pass the same options, e.g. --quick)."""
import sys

from kvbridge.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
