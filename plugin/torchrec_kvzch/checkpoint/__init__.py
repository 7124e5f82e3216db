"""Checkpoints through torch.distributed.checkpoint: the DCP planners, the writer, the async
stager, checksums and the run-directory manager. They reach the rows through the KV tensor."""

from torchrec_kvzch.checkpoint.manager import CheckpointError, CheckpointManager
from torchrec_kvzch.checkpoint.load_planner import KVZCHLoadPlanner
from torchrec_kvzch.checkpoint.save_planner import KVZCHSavePlanner
from torchrec_kvzch.checkpoint.staging import KVZCHAsyncStager
from torchrec_kvzch.checkpoint.writer import KVZCHFileSystemWriter

__all__ = ["CheckpointError", "CheckpointManager", "KVZCHAsyncStager", "KVZCHFileSystemWriter", "KVZCHLoadPlanner",
           "KVZCHSavePlanner"]
