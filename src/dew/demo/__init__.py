"""The main job: a tiny model, example tasks and a run that visibly learns on a CPU.

``dew demo`` (see :mod:`dew.demo.run`) trains; :mod:`dew.demo.model` builds the tiny
model and tokenizer. Importing this package imports nothing heavy.
"""
