"""The Ray side of TuneFleet: the Ray adapter, the controller, training and serving."""
