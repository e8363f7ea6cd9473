"""The model classes the CPU tests load, registered alone (SGLANG_EXTERNAL_MODEL_PACKAGE): importing all
of SGLang's model files takes a minute on a CI core."""
