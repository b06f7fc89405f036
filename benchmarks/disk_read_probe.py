#!/usr/bin/env python
"""Disk read bandwidth probe (#29): how fast the checkpoint disk of the benchmark machine reads cold data, with one
reader (what ``max_host_memory``'s reader thread does) and with several readers in parallel.

Writes a ``--size-gib`` file of random bytes to ``--dir``, then for each ``readers × chunk`` setting drops the file's
page cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` after an ``fsync``) and reads the whole file: each reader takes
every ``readers``-th chunk with ``os.preadv`` into its own host buffer. Reported: GiB/s per setting (median of
``--repeats``). The file is deleted at the end.

Usage::

    python -m benchmarks run disk-read-probe          # on the H200 machine (benchmarks/h200/run_all.sh)
    python -m benchmarks.disk_read_probe --dir /tmp --size-gib 8 --out /tmp/disk
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20


def drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def write_file(path: Path, size: int) -> float:
    block = os.urandom(64 * MiB)
    start = time.perf_counter()
    with open(path, "wb") as handle:
        written = 0
        while written < size:
            handle.write(block[: min(len(block), size - written)])
            written += min(len(block), size - written)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - start


def read_all(path: Path, size: int, readers: int, chunk: int) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_cache(fd)
        chunks = [(offset, min(chunk, size - offset)) for offset in range(0, size, chunk)]
        errors: list[BaseException] = []

        def work(index: int) -> None:
            buffer = bytearray(chunk)
            view = memoryview(buffer)
            try:
                for offset, length in chunks[index::readers]:
                    done = 0
                    while done < length:
                        got = os.preadv(fd, [view[done:length]], offset + done)
                        if got <= 0:
                            raise OSError(f"short read at {offset + done}")
                        done += got
            except BaseException as error:  # reported by the caller
                errors.append(error)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(readers)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
        if errors:
            raise errors[0]
        return seconds
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a folder on the disk to measure")
    parser.add_argument("--size-gib", type=float, default=8.0)
    parser.add_argument("--settings", default="1x64,1x8,2x32,4x16,8x16,16x8",
                        help="readers×chunk MiB, comma separated")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="a small file (checks the script)")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json and PREFIX.md")
    args = parser.parse_args(argv)
    size = int((0.0625 if args.smoke else args.size_gib) * GiB)
    settings = []
    for item in args.settings.split(","):
        readers, chunk = item.split("x")
        settings.append((int(readers), int(chunk) * MiB))
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "omni-disk-probe.bin"
    rows = []
    try:
        write_s = write_file(path, size)
        print(f"wrote {size / GiB:.2f} GiB in {write_s:.1f} s ({size / GiB / write_s:.2f} GiB/s)", flush=True)
        for readers, chunk in settings:
            times = [read_all(path, size, readers, chunk) for _ in range(args.repeats)]
            seconds = statistics.median(times)
            rows.append({"readers": readers, "chunk_bytes": chunk, "seconds": times,
                         "gib_per_s": size / GiB / seconds})
            print(f"{readers} readers × {chunk // MiB} MiB chunks: {size / GiB / seconds:.2f} GiB/s", flush=True)
    finally:
        path.unlink(missing_ok=True)
    report = {"dir": str(folder), "size_bytes": size, "write_seconds": write_s, "rows": rows,
              "smoke": args.smoke, "filesystem": os.statvfs(folder).f_bsize}
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=2))
    lines = ["# Disk read bandwidth (cold: page cache dropped before each read)", "",
             f"{size / GiB:.2f} GiB file in {folder}; written at {size / GiB / write_s:.2f} GiB/s (fsync'd).", "",
             "| readers | chunk | read GiB/s |", "|---|---|---|"]
    lines += [f"| {r['readers']} | {r['chunk_bytes'] // MiB} MiB | {r['gib_per_s']:.2f} |" for r in rows]
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
