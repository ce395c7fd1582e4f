"""The synthetic-slide cache is written once when processes race on a cold cache: one writes under a lock and
renames each file into place, the others wait and reuse it."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

from wsitrain.slides.synth import MANIFEST, write_synthetic_dataset


def _write(out: str, q: mp.Queue) -> None:
    calls = []
    import wsitrain.slides.synth as synth

    real = synth.write_synthetic_slide

    def counted(path: Path, **kw: object) -> Path:
        calls.append(Path(path).name)
        return real(path, **kw)  # type: ignore[arg-type]

    synth.write_synthetic_slide = counted  # this child process only
    csv_path = write_synthetic_dataset(out, n=3, size=256, seed=5)
    q.put((os.getpid(), len(calls), csv_path.read_text()))


def test_two_processes_on_a_cold_cache_write_it_once(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_write, args=(str(tmp_path / "cache"), q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(r[1] for r in results) == [0, 3]  # one process wrote the 3 slides, the other reused them
    assert results[0][2] == results[1][2] and results[0][2].startswith("slide,label")
    names = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert names == sorted([".synth.lock", MANIFEST, "labels.csv", "slide_000.svs", "slide_001.svs",
                            "slide_002.svs"])  # no temp files or staging folders left
