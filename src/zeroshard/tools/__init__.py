"""Tools around the library: the `zeroshard` CLI and its commands, the memory/communication
estimator, the stage advisor, the benchmark, the demo and the models they use. The top layer:
nothing below imports it."""
