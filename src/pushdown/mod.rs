//! Near-data pushdown: running the frozen prefix of a model on objects. So far: cutting an ONNX
//! model into the prefix that computes a split tensor ([`prefix`]). The model registry, ONNX
//! Runtime execution and the pushdown GET come next (issue 3).

pub mod prefix;
