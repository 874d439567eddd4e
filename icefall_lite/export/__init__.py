"""Export: scaled modules converted to plain ones, ONNX files in sherpa-onnx's LSTM format, the onnxruntime
and sherpa-onnx runners."""
