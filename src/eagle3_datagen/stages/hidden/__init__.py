"""Stage 4: one prefill pass captures EAGLE-3's auxiliary layers and the final layer.

Each hidden-state job is one shard (`shard.capture_shard`: parts, resume, index); the forward passes
run in the node's capture runner (`runner`), which loads the target model once for every shard job on
the node. A job imports only `runner`'s side of it, without torch.
"""
