"""Where a deployment's host KV tier lives (--kv-offloading-size): a shared-memory file per
scheduler shard on each host, named by the deployment (its NATS and its subjects) so that
two deployments never share one; the workers map it (services/worker/kv_tier.py) and
`llmbus serve` removes it when it stops."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SHM = Path("/dev/shm")


def tier_path(nats_url: str, subject_prefix: str, rank: int) -> str:
    digest = hashlib.blake2b(f"{nats_url}|{subject_prefix}".encode(), digest_size=6).hexdigest()
    return str(SHM / f"llmbus-kv-{os.getuid()}-{digest}-dp{rank}")


def remove_tier_files(nats_url: str, subject_prefix: str, shards: int, disk_folder: str | None = None) -> None:
    """Each shard's file, its tensor-parallel ranks' (`<file>-tp<rank>`), and their disk
    tiers' in `disk_folder` (`<file>-disk`, `<file>-tp<rank>-disk`)."""
    for rank in range(shards):
        path = Path(tier_path(nats_url, subject_prefix, rank))
        folders = [path.parent] + ([Path(disk_folder)] if disk_folder else [])
        for folder in folders:
            for file in (folder / path.name, *folder.glob(path.name + "-tp*"), folder / (path.name + "-disk")):
                file.unlink(missing_ok=True)
