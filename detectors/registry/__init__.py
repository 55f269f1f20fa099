"""The registry: artifact files and declared inputs (:mod:`.artifact`), the detector kinds (:mod:`.kinds`), the MLflow
store, logging, registering and the champion rule (:mod:`.store`), a sqlite store moved with its project
(:mod:`.relocate`), and the pyfunc entry point that MLflow loads and serves (:mod:`.pyfunc`). The ``dynrag`` command
(:mod:`detectors.cli`) drives it from the shell."""
