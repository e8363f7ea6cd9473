"""Stage 2, responses: the conversation loop, its journaled concurrent runner, and the job."""
