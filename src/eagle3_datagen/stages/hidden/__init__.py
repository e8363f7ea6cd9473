"""Stage 4: one prefill pass captures EAGLE-3's auxiliary layers and the final layer.

Each hidden-state job is one shard (`shard.capture_shard`: parts, resume, index); the forward passes
run in the node's capture runner (`runner`), which loads the target model once for every shard job on
the node.
"""

from eagle3_datagen.stages.hidden.runner import CaptureFailed, capture_with_runner, serve
from eagle3_datagen.stages.hidden.shard import ShardCancelled, capture_shard

__all__ = ["CaptureFailed", "ShardCancelled", "capture_shard", "capture_with_runner", "serve"]
