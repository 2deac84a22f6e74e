"""Print the pip requirement to use for torch on this machine.

Order: $TORCH_SPEC if set; else, when pip is configured with local find-links
directories holding a torch wheel (offline/CI machines ship a CPU build that
way), pin that exact version so pip takes the local file instead of pulling
the newest CUDA build; else plain ``torch`` (what a real user wants).
"""
import glob
import os
import re
import subprocess
import sys


def find_links() -> list[str]:
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if "find-links" in line and "=" in line:
            dirs += line.split("=", 1)[1].strip().strip("'\"").split()
    return [d.removeprefix("file://") for d in dirs]


def main() -> None:
    if os.environ.get("TORCH_SPEC"):
        print(os.environ["TORCH_SPEC"])
        return
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    versions = []
    for d in find_links():
        for whl in glob.glob(os.path.join(d, f"torch-*-{tag}-*.whl")):
            m = re.match(r"torch-([0-9][^-]*)-", os.path.basename(whl))
            if m:
                versions.append(m.group(1))
    if versions:
        best = max(versions, key=lambda v: [int(x) for x in re.findall(r"\d+", v.split("+")[0])])
        print(f"torch=={best}")
    else:
        print("torch")


if __name__ == "__main__":
    main()
