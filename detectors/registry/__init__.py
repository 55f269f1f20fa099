"""The registry: artifact files (:mod:`.artifact`), the detector kinds (:mod:`.kinds`), the MLflow store,
logging, registering and the champion rule (:mod:`.store`), and the pyfunc entry point (:mod:`.pyfunc`)."""
