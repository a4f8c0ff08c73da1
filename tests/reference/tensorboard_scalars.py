"""Reads a directory of TensorBoard event files with TensorBoard's own reader and prints
every scalar as JSON: {tag: [[step, value], ...]}.

  tensorboard_scalars.py DIR
"""

import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

accumulator = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
accumulator.Reload()
scalars = {tag: [[e.step, e.value] for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
print(json.dumps(scalars))
