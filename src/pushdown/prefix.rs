//! Cutting an ONNX model at a tensor: the prefix subgraph that computes it, and nothing else.
//!
//! The cut works on the protobuf wire format instead of decoding the model into generated types:
//! it reads just the fields it needs (node inputs and outputs, tensor and value names) and copies
//! every other byte through untouched. So fields this code does not know about (newer ONNX
//! versions, vendor extensions, external-data references, metadata) survive the cut exactly,
//! which prost-generated types cannot promise (prost drops unknown fields on re-encode), and no
//! copy of `onnx.proto` is needed. See `docs/adr/0002-onnx-prefix-cut-on-the-wire.md`.
//!
//! Wire format: <https://protobuf.dev/programming-guides/encoding/>. ONNX field numbers:
//! `onnx/onnx.proto` of the ONNX project (ModelProto.graph = 7; GraphProto node = 1,
//! initializer = 5, input = 11, output = 12, value_info = 13, quantization_annotation = 14,
//! sparse_initializer = 15; NodeProto input = 1, output = 2, attribute = 5; AttributeProto
//! g = 6, graphs = 11; TensorProto name = 8; ValueInfoProto name = 1; SparseTensorProto
//! values = 1; TensorAnnotation tensor_name = 1).
//!
//! Algorithm: walk back from the requested tensors through their producing nodes (including
//! names that nodes' subgraphs read from the enclosing scope), keep those nodes in their original
//! (topological) order, keep the initializers, graph inputs, value_info entries and annotations
//! they reference, and make the requested tensors the graph's outputs.

use std::collections::{HashMap, HashSet};

/// Why a model could not be cut.
#[derive(Debug, thiserror::Error)]
pub enum CutError {
    #[error("the model is not valid protobuf: {0}")]
    Malformed(&'static str),
    #[error("the model has no graph")]
    NoGraph,
    #[error("tensor {name:?} is not computed by the graph (known tensors include: {known})")]
    UnknownTensor { name: String, known: String },
    #[error("no split tensor requested")]
    NothingRequested,
}

const MODEL_GRAPH: u32 = 7;
const GRAPH_NODE: u32 = 1;
const GRAPH_INITIALIZER: u32 = 5;
const GRAPH_INPUT: u32 = 11;
const GRAPH_OUTPUT: u32 = 12;
const GRAPH_VALUE_INFO: u32 = 13;
const GRAPH_QUANT_ANNOTATION: u32 = 14;
const GRAPH_SPARSE_INITIALIZER: u32 = 15;
const NODE_INPUT: u32 = 1;
const NODE_OUTPUT: u32 = 2;
const NODE_ATTRIBUTE: u32 = 5;
const NODE_NAME: u32 = 3;
/// ValueInfoProto.type = 2.
const VALUE_INFO_TYPE: u32 = 2;
const TYPE_TENSOR: u32 = 1;
const TENSOR_TYPE_ELEM: u32 = 1;
const TENSOR_TYPE_SHAPE: u32 = 2;
const SHAPE_DIM: u32 = 1;
const DIM_VALUE: u32 = 1;
const ATTR_GRAPH: u32 = 6;
const ATTR_GRAPHS: u32 = 11;
const TENSOR_NAME: u32 = 8;
const VALUE_INFO_NAME: u32 = 1;
const SPARSE_VALUES: u32 = 1;
const ANNOTATION_TENSOR_NAME: u32 = 1;

const WIRE_VARINT: u8 = 0;
const WIRE_I64: u8 = 1;
const WIRE_LEN: u8 = 2;
const WIRE_I32: u8 = 5;

/// One field of a message as it appears on the wire.
#[derive(Debug, Clone, Copy)]
struct Field<'a> {
    number: u32,
    wire: u8,
    /// The whole field, key included: what gets copied through.
    raw: &'a [u8],
    /// The value: the content for length-delimited fields, the encoded bytes otherwise.
    payload: &'a [u8],
}

fn read_varint(buf: &[u8], pos: &mut usize) -> Result<u64, CutError> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *buf.get(*pos).ok_or(CutError::Malformed("truncated varint"))?;
        *pos += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(CutError::Malformed("varint too long"))
}

fn write_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn write_len_field(out: &mut Vec<u8>, number: u32, payload: &[u8]) {
    write_varint(out, (u64::from(number) << 3) | u64::from(WIRE_LEN));
    write_varint(out, payload.len() as u64);
    out.extend_from_slice(payload);
}

/// Splits a message into its fields (no recursion).
fn fields(buf: &[u8]) -> Result<Vec<Field<'_>>, CutError> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < buf.len() {
        let start = pos;
        let key = read_varint(buf, &mut pos)?;
        let number = u32::try_from(key >> 3).map_err(|_| CutError::Malformed("field number out of range"))?;
        let wire = (key & 7) as u8;
        let payload_start;
        match wire {
            WIRE_VARINT => {
                payload_start = pos;
                read_varint(buf, &mut pos)?;
            }
            WIRE_I64 => {
                payload_start = pos;
                pos += 8;
            }
            WIRE_I32 => {
                payload_start = pos;
                pos += 4;
            }
            WIRE_LEN => {
                let len = usize::try_from(read_varint(buf, &mut pos)?)
                    .map_err(|_| CutError::Malformed("length out of range"))?;
                payload_start = pos;
                pos = pos.checked_add(len).ok_or(CutError::Malformed("length overflow"))?;
            }
            _ => return Err(CutError::Malformed("unsupported wire type (groups are not used by ONNX)")),
        }
        if pos > buf.len() {
            return Err(CutError::Malformed("field runs past the end"));
        }
        out.push(Field { number, wire, raw: &buf[start..pos], payload: &buf[payload_start..pos] });
    }
    Ok(out)
}

/// The string values of length-delimited field `number` of a message.
fn strings(msg: &[u8], number: u32) -> Result<Vec<&str>, CutError> {
    fields(msg)?
        .into_iter()
        .filter(|f| f.number == number && f.wire == WIRE_LEN)
        .map(|f| std::str::from_utf8(f.payload).map_err(|_| CutError::Malformed("name is not UTF-8")))
        .collect()
}

fn first_string(msg: &[u8], number: u32) -> Result<Option<&str>, CutError> {
    Ok(strings(msg, number)?.into_iter().next())
}

/// A node's inputs (including names its subgraphs read from the enclosing scope) and outputs.
struct NodeInfo<'a> {
    inputs: Vec<&'a str>,
    outputs: Vec<&'a str>,
}

fn node_info(node: &[u8]) -> Result<NodeInfo<'_>, CutError> {
    node_info_at(node, 0)
}

/// How deep subgraphs (an `If`'s branches, a `Loop`'s body) may nest: real models nest a few
/// levels; a hostile file nested thousands deep would otherwise exhaust the stack.
const MAX_SUBGRAPH_DEPTH: usize = 32;

fn node_info_at(node: &[u8], depth: usize) -> Result<NodeInfo<'_>, CutError> {
    if depth > MAX_SUBGRAPH_DEPTH {
        return Err(CutError::Malformed("subgraphs nested too deep"));
    }
    let mut inputs: Vec<&str> = strings(node, NODE_INPUT)?.into_iter().filter(|s| !s.is_empty()).collect();
    let outputs = strings(node, NODE_OUTPUT)?.into_iter().filter(|s| !s.is_empty()).collect();
    for attr in fields(node)?.into_iter().filter(|f| f.number == NODE_ATTRIBUTE && f.wire == WIRE_LEN) {
        for g in fields(attr.payload)?
            .into_iter()
            .filter(|f| (f.number == ATTR_GRAPH || f.number == ATTR_GRAPHS) && f.wire == WIRE_LEN)
        {
            inputs.extend(outer_references(g.payload, depth + 1)?);
        }
    }
    Ok(NodeInfo { inputs, outputs })
}

/// Names a subgraph reads but does not define itself (ONNX's implicit outer-scope inputs).
fn outer_references(graph: &[u8], depth: usize) -> Result<Vec<&str>, CutError> {
    let mut defined: HashSet<&str> = HashSet::new();
    let mut used = Vec::new();
    for f in fields(graph)? {
        match f.number {
            GRAPH_INPUT => defined.extend(first_string(f.payload, VALUE_INFO_NAME)?),
            GRAPH_INITIALIZER => defined.extend(first_string(f.payload, TENSOR_NAME)?),
            GRAPH_NODE => {
                let info = node_info_at(f.payload, depth)?;
                used.extend(info.inputs);
                defined.extend(info.outputs);
            }
            _ => {}
        }
    }
    Ok(used.into_iter().filter(|u| !defined.contains(u)).collect())
}

/// A graph input the model's caller feeds (initializers that older exporters also list as inputs
/// are left out): its name, ONNX element type and dimensions (`None`: symbolic, as a batch axis).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GraphInput {
    pub(crate) name: String,
    pub(crate) elem_type: u64,
    pub(crate) dims: Vec<Option<u64>>,
}

/// ONNX's element type of `float` tensors.
pub(crate) const ELEM_FLOAT: u64 = 1;

/// ONNX's element type of `int64` tensors (a text encoder's token ids and attention mask).
pub(crate) const ELEM_INT64: u64 = 7;

/// The inputs a caller feeds.
///
/// # Errors
/// A model that is not valid protobuf or has no graph.
pub(crate) fn graph_inputs(model: &[u8]) -> Result<Vec<GraphInput>, CutError> {
    let graph = graph_of(model)?;
    let mut initializers: HashSet<&str> = HashSet::new();
    for f in fields(graph)?.into_iter().filter(|f| f.number == GRAPH_INITIALIZER && f.wire == WIRE_LEN) {
        initializers.extend(first_string(f.payload, TENSOR_NAME)?);
    }
    let mut out = Vec::new();
    for f in fields(graph)?.into_iter().filter(|f| f.number == GRAPH_INPUT && f.wire == WIRE_LEN) {
        let Some(name) = first_string(f.payload, VALUE_INFO_NAME)? else { continue };
        if initializers.contains(name) {
            continue;
        }
        let (mut elem_type, mut dims) = (0, Vec::new());
        let mut tensors = Vec::new();
        for t in submessages(f.payload, VALUE_INFO_TYPE)? {
            tensors.extend(submessages(t, TYPE_TENSOR)?);
        }
        for t in tensors {
            for g in fields(t)? {
                match (g.number, g.wire) {
                    (TENSOR_TYPE_ELEM, WIRE_VARINT) => elem_type = varint(g.payload)?,
                    (TENSOR_TYPE_SHAPE, WIRE_LEN) => {
                        for d in submessages(g.payload, SHAPE_DIM)? {
                            let value = fields(d)?.into_iter().find(|v| v.number == DIM_VALUE && v.wire == WIRE_VARINT);
                            dims.push(value.map(|v| varint(v.payload)).transpose()?.filter(|&v| v > 0));
                        }
                    }
                    _ => {}
                }
            }
        }
        out.push(GraphInput { name: name.to_owned(), elem_type, dims });
    }
    Ok(out)
}

/// A node as an exporter named it (torch's `dynamo=False` exporter writes the module path,
/// `/layer1/layer1.0/conv1/Conv`), and its outputs.
#[derive(Debug, Clone)]
pub(crate) struct NamedNode {
    pub(crate) name: String,
    pub(crate) outputs: Vec<String>,
}

/// The graph's nodes, in order.
///
/// # Errors
/// A model that is not valid protobuf or has no graph.
pub(crate) fn named_nodes(model: &[u8]) -> Result<Vec<NamedNode>, CutError> {
    let graph = graph_of(model)?;
    let mut out = Vec::new();
    for f in fields(graph)?.into_iter().filter(|f| f.number == GRAPH_NODE && f.wire == WIRE_LEN) {
        let name = first_string(f.payload, NODE_NAME)?.unwrap_or_default().to_owned();
        let outputs = node_info(f.payload)?.outputs.into_iter().map(str::to_owned).collect();
        out.push(NamedNode { name, outputs });
    }
    Ok(out)
}

/// The payloads of length-delimited field `number` of a message.
fn submessages(msg: &[u8], number: u32) -> Result<Vec<&[u8]>, CutError> {
    Ok(fields(msg)?.into_iter().filter(|f| f.number == number && f.wire == WIRE_LEN).map(|f| f.payload).collect())
}

/// A varint field's value.
fn varint(payload: &[u8]) -> Result<u64, CutError> {
    read_varint(payload, &mut 0)
}

/// The tensor names a cut can target: every node output, in graph order.
///
/// # Errors
/// A model that is not valid protobuf or has no graph.
pub fn tensor_names(model: &[u8]) -> Result<Vec<String>, CutError> {
    let graph = graph_of(model)?;
    let mut names = Vec::new();
    for f in fields(graph)?.into_iter().filter(|f| f.number == GRAPH_NODE) {
        names.extend(node_info(f.payload)?.outputs.into_iter().map(str::to_owned));
    }
    Ok(names)
}

fn graph_of(model: &[u8]) -> Result<&[u8], CutError> {
    fields(model)?
        .into_iter()
        .find(|f| f.number == MODEL_GRAPH && f.wire == WIRE_LEN)
        .map(|f| f.payload)
        .ok_or(CutError::NoGraph)
}

/// Returns a model whose graph computes exactly `outputs` (in that order) from the original
/// inputs, with everything else byte-for-byte as in `model`.
///
/// # Errors
/// Malformed protobuf, no graph, or a requested tensor no node computes.
pub fn cut(model: &[u8], outputs: &[&str]) -> Result<Vec<u8>, CutError> {
    rewrite(model, &[], outputs, false)
}

/// Returns the subgraph that computes `outputs` from `inputs` (tensors inside the model, which
/// become float graph inputs): the frozen layers between a split and the freeze split, which the
/// compute tier runs.
///
/// # Errors
/// As for [`cut`].
pub fn extract(model: &[u8], inputs: &[&str], outputs: &[&str]) -> Result<Vec<u8>, CutError> {
    rewrite(model, inputs, outputs, false)
}

/// Returns the whole model with `outputs` as its graph outputs instead of the original ones
/// (every node kept): the reference a prefix is checked against.
///
/// # Errors
/// As for [`cut`].
pub fn expose(model: &[u8], outputs: &[&str]) -> Result<Vec<u8>, CutError> {
    rewrite(model, &[], outputs, true)
}

/// TensorProto.data_location = 14; EXTERNAL = 1.
const TENSOR_DATA_LOCATION: u32 = 14;

/// Whether any initializer keeps its data in an external file (a graph shipped elsewhere would
/// lose its weights).
///
/// # Errors
/// The bytes are not an ONNX model.
pub fn has_external_data(model: &[u8]) -> Result<bool, CutError> {
    for f in fields(graph_of(model)?)?.into_iter().filter(|f| f.number == GRAPH_INITIALIZER) {
        let external = fields(f.payload)?
            .iter()
            .any(|t| t.number == TENSOR_DATA_LOCATION && t.wire == WIRE_VARINT && t.payload == [1]);
        if external {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `TypeProto { tensor_type: { elem_type: FLOAT } }` (TypeProto.tensor_type = 1,
/// Tensor.elem_type = 1, TensorProto.DataType.FLOAT = 1).
const FLOAT_TENSOR_TYPE: &[u8] = &[0x0A, 0x02, 0x08, 0x01];

fn rewrite(model: &[u8], inputs: &[&str], outputs: &[&str], keep_all: bool) -> Result<Vec<u8>, CutError> {
    if outputs.is_empty() {
        return Err(CutError::NothingRequested);
    }
    let model_fields = fields(model)?;
    let graph = graph_of(model)?;
    let graph_fields = fields(graph)?;

    let mut nodes = Vec::new();
    let mut producer: HashMap<&str, usize> = HashMap::new();
    for (i, f) in graph_fields.iter().enumerate().filter(|(_, f)| f.number == GRAPH_NODE) {
        let info = node_info(f.payload)?;
        for o in &info.outputs {
            producer.insert(o, i);
        }
        nodes.push((i, info));
    }
    let by_index: HashMap<usize, &NodeInfo<'_>> = nodes.iter().map(|(i, n)| (*i, n)).collect();
    for name in outputs.iter().chain(inputs) {
        if !producer.contains_key(name) {
            let known: Vec<&str> = nodes.iter().flat_map(|(_, n)| n.outputs.iter().copied()).take(20).collect();
            return Err(CutError::UnknownTensor { name: (*name).to_owned(), known: known.join(", ") });
        }
    }

    // Backward walk from the requested tensors.
    let mut keep_nodes: HashSet<usize> = HashSet::new();
    let mut needed: HashSet<&str> = outputs.iter().copied().collect();
    let mut stack: Vec<&str> = outputs.to_vec();
    let new_inputs: HashSet<&str> = inputs.iter().copied().collect();
    while let Some(name) = stack.pop() {
        if new_inputs.contains(name) {
            continue;
        }
        let Some(&idx) = producer.get(name) else { continue };
        if !keep_nodes.insert(idx) {
            continue;
        }
        for input in &by_index[&idx].inputs {
            if needed.insert(input) {
                stack.push(input);
            }
        }
    }
    let produced: HashSet<&str> = keep_nodes.iter().flat_map(|i| by_index[i].outputs.iter().copied()).collect();
    let requested: HashSet<&str> = outputs.iter().copied().collect();

    // Type information for the new outputs, wherever the original graph had it.
    let mut output_info: HashMap<&str, &[u8]> = HashMap::new();
    for f in graph_fields.iter().filter(|f| f.number == GRAPH_VALUE_INFO || f.number == GRAPH_OUTPUT) {
        if let Some(name) = first_string(f.payload, VALUE_INFO_NAME)?
            && requested.contains(name)
        {
            output_info.entry(name).or_insert(f.payload);
        }
    }

    let mut out_graph = Vec::with_capacity(graph.len());
    for (i, f) in graph_fields.iter().enumerate() {
        let keep = match f.number {
            GRAPH_OUTPUT => false,
            GRAPH_VALUE_INFO if keep_all => {
                first_string(f.payload, VALUE_INFO_NAME)?.is_none_or(|n| !requested.contains(n))
            }
            _ if keep_all => true,
            GRAPH_NODE => keep_nodes.contains(&i),
            GRAPH_INITIALIZER => first_string(f.payload, TENSOR_NAME)?.is_some_and(|n| needed.contains(n)),
            GRAPH_SPARSE_INITIALIZER => {
                let values = fields(f.payload)?.into_iter().find(|v| v.number == SPARSE_VALUES).map(|v| v.payload);
                match values {
                    Some(v) => first_string(v, TENSOR_NAME)?.is_some_and(|n| needed.contains(n)),
                    None => false,
                }
            }
            GRAPH_INPUT => first_string(f.payload, VALUE_INFO_NAME)?.is_some_and(|n| needed.contains(n)),
            GRAPH_VALUE_INFO => first_string(f.payload, VALUE_INFO_NAME)?.is_some_and(|n| {
                (needed.contains(n) || produced.contains(n)) && !requested.contains(n) && !new_inputs.contains(n)
            }),
            GRAPH_QUANT_ANNOTATION => first_string(f.payload, ANNOTATION_TENSOR_NAME)?
                .is_some_and(|n| needed.contains(n) || produced.contains(n)),
            _ => true,
        };
        if keep {
            out_graph.extend_from_slice(f.raw);
        }
    }
    // New inputs are float tensors of any shape: a recorded shape may pin the batch size.
    for name in inputs {
        let mut info = Vec::new();
        write_len_field(&mut info, VALUE_INFO_NAME, name.as_bytes());
        write_len_field(&mut info, VALUE_INFO_TYPE, FLOAT_TENSOR_TYPE);
        write_len_field(&mut out_graph, GRAPH_INPUT, &info);
    }
    for name in outputs {
        match output_info.get(name) {
            Some(info) => write_len_field(&mut out_graph, GRAPH_OUTPUT, info),
            None => {
                let mut info = Vec::new();
                write_len_field(&mut info, VALUE_INFO_NAME, name.as_bytes());
                write_len_field(&mut out_graph, GRAPH_OUTPUT, &info);
            }
        }
    }

    let mut out = Vec::with_capacity(model.len());
    for f in &model_fields {
        if f.number == MODEL_GRAPH && f.wire == WIRE_LEN {
            write_len_field(&mut out, MODEL_GRAPH, &out_graph);
        } else {
            out.extend_from_slice(f.raw);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    //! Hand-encoded graphs: `x -> A -> a -> B -> b`, plus a branch `a -> C -> c` and an
    //! initializer `w` read by B.
    use super::*;

    fn s(out: &mut Vec<u8>, n: u32, v: &str) {
        write_len_field(out, n, v.as_bytes());
    }

    fn node(inputs: &[&str], outputs: &[&str], op: &str) -> Vec<u8> {
        let mut n = Vec::new();
        for i in inputs {
            s(&mut n, NODE_INPUT, i);
        }
        for o in outputs {
            s(&mut n, NODE_OUTPUT, o);
        }
        s(&mut n, 4, op);
        n
    }

    fn value_info(name: &str) -> Vec<u8> {
        let mut v = Vec::new();
        s(&mut v, VALUE_INFO_NAME, name);
        v
    }

    fn model() -> Vec<u8> {
        let mut g = Vec::new();
        write_len_field(&mut g, GRAPH_NODE, &node(&["x"], &["a"], "A"));
        write_len_field(&mut g, GRAPH_NODE, &node(&["a", "w"], &["b"], "B"));
        write_len_field(&mut g, GRAPH_NODE, &node(&["a"], &["c"], "C"));
        s(&mut g, 2, "g");
        let mut w = Vec::new();
        write_varint(&mut w, 1 << 3);
        write_varint(&mut w, 7);
        s(&mut w, TENSOR_NAME, "w");
        write_len_field(&mut g, GRAPH_INITIALIZER, &w);
        write_len_field(&mut g, GRAPH_INPUT, &value_info("x"));
        write_len_field(&mut g, GRAPH_OUTPUT, &value_info("b"));
        write_len_field(&mut g, GRAPH_VALUE_INFO, &value_info("a"));
        write_len_field(&mut g, 99, b"unknown graph field");
        let mut m = Vec::new();
        write_varint(&mut m, 1 << 3);
        write_varint(&mut m, 8);
        write_len_field(&mut m, MODEL_GRAPH, &g);
        write_len_field(&mut m, 123, b"unknown model field");
        m
    }

    fn graph_summary(model: &[u8]) -> (Vec<String>, Vec<String>, Vec<String>) {
        let g = graph_of(model).expect("graph");
        let mut ops = Vec::new();
        let mut outs = Vec::new();
        let mut inits = Vec::new();
        for f in fields(g).expect("fields") {
            match f.number {
                GRAPH_NODE => ops.push(first_string(f.payload, 4).expect("op").unwrap_or_default().to_owned()),
                GRAPH_OUTPUT => {
                    outs.push(first_string(f.payload, VALUE_INFO_NAME).expect("name").unwrap_or_default().to_owned())
                }
                GRAPH_INITIALIZER => {
                    inits.push(first_string(f.payload, TENSOR_NAME).expect("name").unwrap_or_default().to_owned())
                }
                _ => {}
            }
        }
        (ops, outs, inits)
    }

    #[test]
    fn cut_keeps_only_the_ancestors() {
        let m = model();
        let a = cut(&m, &["a"]).expect("cut");
        assert_eq!(graph_summary(&a), (vec!["A".into()], vec!["a".into()], vec![]));
        let b = cut(&m, &["b"]).expect("cut");
        assert_eq!(graph_summary(&b), (vec!["A".into(), "B".into()], vec!["b".into()], vec!["w".into()]));
        let both = cut(&m, &["c", "b"]).expect("cut");
        assert_eq!(graph_summary(&both).1, vec!["c".to_owned(), "b".to_owned()]);
    }

    #[test]
    fn unknown_fields_survive_and_value_info_becomes_the_output() {
        let a = cut(&model(), &["a"]).expect("cut");
        assert!(a.windows(19).any(|w| w == b"unknown model field"));
        assert!(a.windows(19).any(|w| w == b"unknown graph field"));
        let g = graph_of(&a).expect("graph");
        assert!(
            !fields(g).expect("fields").iter().any(|f| f.number == GRAPH_VALUE_INFO),
            "a moved from value_info to output"
        );
        // Cutting at the original output reproduces the original graph's computation.
        assert_eq!(graph_summary(&cut(&model(), &["b"]).expect("cut")).0, vec!["A", "B"]);
    }

    #[test]
    fn unknown_tensor_names_what_exists() {
        let e = cut(&model(), &["nope"]).expect_err("unknown");
        let msg = e.to_string();
        assert!(msg.contains("nope") && msg.contains("a, b, c"), "{msg}");
        assert!(matches!(cut(b"\xff\xff", &["a"]), Err(CutError::Malformed(_))));
        assert!(matches!(cut(&model(), &[]), Err(CutError::NothingRequested)));
        assert_eq!(tensor_names(&model()).expect("names"), vec!["a", "b", "c"]);
    }

    #[test]
    fn expose_keeps_every_node() {
        let e = expose(&model(), &["a"]).expect("expose");
        assert_eq!(graph_summary(&e), (vec!["A".into(), "B".into(), "C".into()], vec!["a".into()], vec!["w".into()]));
    }

    #[test]
    fn subgraph_outer_references_are_dependencies() {
        // An If-like node whose then-branch reads `w2` from the enclosing scope.
        let mut sub = Vec::new();
        write_len_field(&mut sub, GRAPH_NODE, &node(&["w2"], &["inner"], "Identity"));
        let mut attr = Vec::new();
        s(&mut attr, 1, "then_branch");
        write_len_field(&mut attr, ATTR_GRAPH, &sub);
        let mut if_node = node(&["cond"], &["out"], "If");
        write_len_field(&mut if_node, NODE_ATTRIBUTE, &attr);
        let mut g = Vec::new();
        write_len_field(&mut g, GRAPH_NODE, &node(&["x"], &["w2"], "Producer"));
        write_len_field(&mut g, GRAPH_NODE, &node(&["x"], &["cond"], "Cond"));
        write_len_field(&mut g, GRAPH_NODE, &if_node);
        let mut m = Vec::new();
        write_len_field(&mut m, MODEL_GRAPH, &g);
        let cutm = cut(&m, &["out"]).expect("cut");
        assert_eq!(graph_summary(&cutm).0, vec!["Producer", "Cond", "If"]);
    }
}
