"""The stream service: what a request does to a stream — create, observe (one POST or a batch), read (forecasts,
smoothed estimates, history), export and import a snapshot — and the documents it answers. It runs the engine
(:mod:`mpflow.service.engine`) and keeps streams in the store (:mod:`mpflow.service.store`)."""
