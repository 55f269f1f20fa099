"""Data sources: QA pairs (:mod:`.qa`, bigbench tasks :mod:`.bigbench`, files :mod:`.files`), Wikipedia
articles (:mod:`.articles`), ids and hash splits (:mod:`.ids`), text normalisation and DioR's
containment label (:mod:`.text`)."""
