"""SGLang: its native `/generate` (`generate`), a launched server (`server`), and its
in-process model runner for capture (`capture`)."""
