"""Services several ops share below qtool/ops: the layer-streaming pipeline (layer_stream), dequantization
of stored formats to dense weights (dequant) and calibration data (calib_data)."""
