"""The CPython standard library's own ``.py`` sources as a code corpus, split by file.

``collect_stdlib_files`` walks ``sysconfig.get_paths()["stdlib"]`` and keeps ``.py`` files,
excluding test suites, IDLE, demos, caches and installed third-party packages (see
``EXCLUDED_DIRS`` / ``_excluded_file``). ``split_files`` assigns every file to train or
held-out by a hash of its relative path and the seed: deterministic, independent of the file
order and stable when files are added or removed. The manifest (JSON) records the Python
version, the stdlib root and both file lists (relative POSIX paths), so the corpus of a
shipped model can be rebuilt and audited.

    python -m training.stdlib_corpus --out stdlib_manifest.json [--heldout-fraction 0.02]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig

from .config import ConfigError
from .data import split_by_hash

EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "idlelib", "__pycache__", "site-packages", "dist-packages",
    "turtledemo", "_bundled", "__phello__",
})


def _excluded_dir(name: str) -> bool:
    return name in EXCLUDED_DIRS or name.startswith(("config-", ".", "test_"))


def _excluded_file(name: str) -> bool:
    return not name.endswith(".py") or name.startswith("test_") or name.endswith("_test.py")


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def collect_stdlib_files(root: str | None = None) -> list[str]:
    """Sorted relative POSIX paths of the stdlib's own ``.py`` files."""
    root = root or stdlib_root()
    out: list[str] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not _excluded_dir(x))
        for n in names:
            if not _excluded_file(n):
                out.append(os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/"))
    return sorted(out)


def split_files(files: list[str], heldout_fraction: float = 0.02, seed: int = 0) -> tuple[list[str], list[str]]:
    """``(train, heldout)`` by file, sorted; a file is held out iff hash(seed, path) < fraction
    (:func:`training.data.split_by_hash`: at least one held out and one kept when ``fraction > 0`` and there are
    >= 2 files)."""
    return split_by_hash(sorted(set(files)), heldout_fraction, seed)


def build_manifest(heldout_fraction: float = 0.02, seed: int = 0, root: str | None = None) -> dict:
    root = root or stdlib_root()
    files = [f for f in collect_stdlib_files(root) if _readable(os.path.join(root, f))]
    train, held = split_files(files, heldout_fraction, seed)
    return {
        "python_version": sys.version.split()[0],
        "stdlib_root": root,
        "seed": seed,
        "heldout_fraction": heldout_fraction,
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "train": train,
        "heldout": held,
    }


def _readable(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return bool(f.read().strip())
    except (UnicodeDecodeError, OSError):
        return False


def write_manifest(path: str, manifest: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, path)


def load_manifest(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def manifest_root(manifest: dict) -> str:
    """Where a manifest's files are read: the stdlib root it recorded or, on a machine without that folder (another
    machine, another Python), this Python's own (a note on stderr says so), whose files of the same names stand in
    for them (the split, by name, is kept: a held-out file stays held out)."""
    root = manifest["stdlib_root"]
    if os.path.isdir(root):
        return root
    here = stdlib_root()
    print(f"note: the stdlib manifest's files were recorded at {root} (Python {manifest.get('python_version')}), "
          f"which this machine lacks: reading the files of those names from {here} (Python "
          f"{sys.version.split()[0]})", file=sys.stderr)
    return here


def manifest_records(manifest: dict) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)`` records ``{"text": source}`` for :func:`training.data.build_datasets`, read from
    :func:`manifest_root`; a file it lacks is left out (a note on stderr counts them), and a split whose files are
    all missing raises a ``ConfigError``."""
    root = manifest_root(manifest)
    missing: list[str] = []

    def read(rels):
        out = []
        for r in rels:
            path = os.path.join(root, r)
            if not os.path.isfile(path):
                missing.append(r)
                continue
            with open(path, encoding="utf-8") as f:
                out.append({"text": f.read()})
        return out

    train, held = read(manifest["train"]), read(manifest["heldout"])
    if missing:
        print(f"note: {len(missing)} of the stdlib manifest's {len(manifest['train']) + len(manifest['heldout'])} "
              f"files are not in {root}, left out: {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}",
              file=sys.stderr)
    for name, records in (("train", train), ("heldout", held)):
        if not records and manifest[name]:  # (--heldout-fraction 0 holds out none)
            raise ConfigError(f"none of the stdlib manifest's {name} files is in {root}: rebuild the manifest on this "
                              "machine (python -m training.stdlib_corpus --out stdlib_manifest.json) and pass it "
                              "with --stdlib-manifest")
    return train, held


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the file-split manifest of the CPython stdlib corpus.")
    ap.add_argument("--out", required=True, help="manifest JSON path")
    ap.add_argument("--heldout-fraction", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    m = build_manifest(args.heldout_fraction, args.seed)
    write_manifest(args.out, m)
    print(f"{len(m['train'])} train / {len(m['heldout'])} held-out files from {m['stdlib_root']} -> {args.out}")


if __name__ == "__main__":
    main()
