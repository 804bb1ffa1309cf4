"""`testbed crosscheck`: the simulator against the emulator (and against Dynamo's mocker as a
peer), the stage-by-stage explanation of any difference, the fault table and the report."""
