"""`zeroshard bench` and `zeroshard advise`: ZeRO stages measured side by side.

Parent side (the CLI process): `launch` spawns the ranks with torchrun and follows their progress,
`report` compares the measurements with `zeroshard.tools.estimator`, `plot` draws the paper's Figure 1 from
them, `advise` recommends a stage. Rank side (inside torchrun; `rank` is the protocol with
the parent): `worker` runs the configurations, each a `subject` (zeroshard) or one of the `peers` (torch's
own data-parallel implementations), `measure` holds the meters, `bandwidth` times all-reduce. `family`
defines the GPT family the bench and its size sweep (`sweep`) scale along. `bench --max-model`: `maxmodel`
(parent) searches the largest model that trains under a per-rank memory cap, one trial of `capped` (ranks)
per size.
"""
