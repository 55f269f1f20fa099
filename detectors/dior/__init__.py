"""DioR (ACL 2025). Early detection: IG attribution over the question (:mod:`.attribution`), a question's
features and the early-set record (:mod:`.early`), the early detectors
(:mod:`.early_detector`: DioR's RNN over IG(Q), and extended feature sets).
Real-time detection: the generation recorder (:mod:`.recorder`), article truncation and entity
labelling (:mod:`.entities`), the MLP detector (:mod:`.realtime_detector`). Networks: :mod:`.nets`."""
