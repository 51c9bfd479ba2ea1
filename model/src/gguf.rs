//! Memory-mapped GGUF files.
//!
//! The header (metadata + tensor directory) is parsed with candle's reader; the
//! tensor data stays in the page cache through `mmap`, so loading a model costs
//! no copy and resident memory follows only the pages actually touched.
//!
//! A model file is untrusted input: every size and offset read from it goes
//! through checked arithmetic (this crate is built with `overflow-checks =
//! false`, so a wrapped product would pass silently), and `general.alignment`
//! is validated by [`header_alignment`] before candle's reader, which divides
//! by it, ever sees the file. docs/fuzzing.md lists the malformed files the
//! tests feed in.

use crate::quant::{QMatrix, QuantFormat};
use crate::{ModelError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use memmap2::Mmap;
use std::collections::HashMap;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where one tensor lives inside the mapped file.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub format: QuantFormat,
    /// GGUF dims, innermost first (for a matrix: `[cols, rows]`).
    pub dims: Vec<usize>,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub len: usize,
}

impl TensorEntry {
    /// Number of elements ([`GgufFile::open`] has checked that it fits).
    pub fn elems(&self) -> usize {
        self.dims.iter().product()
    }
}

/// GGUF metadata value type ids (the spec's `gguf_metadata_value_type`).
mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;

    /// On-disk size of a fixed-size value, `None` for strings, arrays and
    /// unknown ids.
    pub fn fixed_size(t: u32) -> Option<u64> {
        match t {
            0 | 1 | 7 => Some(1), // u8, i8, bool
            2 | 3 => Some(2),     // u16, i16
            4..=6 => Some(4),     // u32, i32, f32
            10..=12 => Some(8),   // u64, i64, f64
            _ => None,
        }
    }
}

/// Deepest nesting of arrays [`header_alignment`] follows (candle's limit).
const MAX_VALUE_DEPTH: usize = 64;

/// A walk over a GGUF header's metadata section that reads no more than it
/// needs: values are skipped by seeking, so a vocabulary of 150k strings
/// costs one length read each.
struct HeaderScan<R> {
    r: R,
    /// GGUF v1 writes lengths and counts as u32 (v2 and v3 as u64).
    v1: bool,
}

impl<R: Read + Seek> HeaderScan<R> {
    fn u32(&mut self) -> std::io::Result<u32> {
        let mut b = [0u8; 4];
        self.r.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn len(&mut self) -> std::io::Result<u64> {
        if self.v1 {
            return self.u32().map(u64::from);
        }
        let mut b = [0u8; 8];
        self.r.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn skip(&mut self, n: u64) -> std::result::Result<(), String> {
        let n = i64::try_from(n).map_err(|_| format!("a length of {n} bytes"))?;
        self.r
            .seek(std::io::SeekFrom::Current(n))
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        let n = self.len().map_err(|e| e.to_string())?;
        let mut buf = Vec::new();
        (&mut self.r)
            .take(n)
            .read_to_end(&mut buf)
            .map_err(|e| e.to_string())?;
        if buf.len() as u64 != n {
            return Err(format!(
                "a string of {n} bytes runs past the end of the file"
            ));
        }
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    fn skip_value(&mut self, t: u32, depth: usize) -> std::result::Result<(), String> {
        if let Some(n) = value_type::fixed_size(t) {
            return self.skip(n);
        }
        match t {
            value_type::STRING => {
                let n = self.len().map_err(|e| e.to_string())?;
                self.skip(n)
            }
            value_type::ARRAY => {
                if depth >= MAX_VALUE_DEPTH {
                    return Err(format!("arrays nested deeper than {MAX_VALUE_DEPTH}"));
                }
                let elem = self.u32().map_err(|e| e.to_string())?;
                let n = self.len().map_err(|e| e.to_string())?;
                match value_type::fixed_size(elem) {
                    Some(size) => self.skip(
                        n.checked_mul(size)
                            .ok_or_else(|| format!("an array of {n} elements"))?,
                    ),
                    None => {
                        // Each element holds at least a length or a type: a
                        // count beyond the file ends at the first short read.
                        for _ in 0..n {
                            self.skip_value(elem, depth + 1)?;
                        }
                        Ok(())
                    }
                }
            }
            other => Err(format!("unknown metadata value type {other}")),
        }
    }

    /// An integer value of one of the types candle's reader honours for
    /// `general.alignment`, `None` for any other type.
    fn int_value(&mut self, t: u32) -> std::io::Result<Option<i64>> {
        let Some(size) = value_type::fixed_size(t) else {
            return Ok(None);
        };
        let mut b = [0u8; 8];
        self.r.read_exact(&mut b[..size as usize])?;
        Ok(match t {
            value_type::U8 => Some(i64::from(b[0])),
            value_type::I8 => Some(i64::from(b[0] as i8)),
            value_type::U16 => Some(i64::from(u16::from_le_bytes([b[0], b[1]]))),
            value_type::I16 => Some(i64::from(i16::from_le_bytes([b[0], b[1]]))),
            value_type::U32 => Some(i64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
            value_type::I32 => Some(i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
            _ => None,
        })
    }
}

/// The key whose value every tensor's data start is rounded up to.
const ALIGNMENT_KEY: &str = "general.alignment";

/// Check `general.alignment` before candle reads the header (candle divides
/// by it: 0 panics). Returns the alignment if the key is present. It must be
/// a power of two stored as an integer of at most 32 bits, as llama.cpp
/// requires. A header that ends early is left to candle's reader to report.
fn header_alignment<R: Read + Seek>(r: R) -> std::result::Result<Option<u64>, String> {
    let mut scan = HeaderScan { r, v1: false };
    let mut magic = [0u8; 4];
    let Ok(()) = scan.r.read_exact(&mut magic) else {
        return Ok(None);
    };
    let Ok(version) = scan.u32() else {
        return Ok(None);
    };
    scan.v1 = version == 1;
    let (Ok(_tensors), Ok(kv_count)) = (scan.len(), scan.len()) else {
        return Ok(None);
    };
    // Every occurrence is checked: candle keeps the last one of a repeated key.
    let mut alignment = None;
    for i in 0..kv_count {
        let (Ok(key), Ok(t)) = (scan.string(), scan.u32()) else {
            return Ok(alignment);
        };
        if key != ALIGNMENT_KEY {
            if scan.skip_value(t, 0).is_err() {
                return Ok(alignment);
            }
            continue;
        }
        let value = scan
            .int_value(t)
            .map_err(|e| format!("metadata `{ALIGNMENT_KEY}` (entry {i}): {e}"))?;
        alignment = match value.and_then(|v| u64::try_from(v).ok()) {
            Some(a) if a.is_power_of_two() => Some(a),
            Some(a) => {
                return Err(format!(
                    "metadata `{ALIGNMENT_KEY}` is {a}; it must be a power of two (e.g. 32)"
                ))
            }
            None => {
                return Err(format!(
                    "metadata `{ALIGNMENT_KEY}` must be a non-negative integer of at most 32 bits (value type {t})"
                ))
            }
        };
    }
    Ok(alignment)
}

/// Size in bytes of a tensor of `dims` (innermost first) in `format`, or why
/// it has none: checked, since the dims come from the file.
fn tensor_len(format: QuantFormat, dims: &[usize]) -> std::result::Result<usize, String> {
    let elems = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("dims {dims:?} overflow the element count"))?;
    let inner = dims.first().copied().unwrap_or(1);
    let rows = elems.checked_div(inner).unwrap_or(0);
    // A row's bytes are at most `inner * block_bytes`; bounding that first
    // keeps `row_bytes`' own (unchecked) product from wrapping.
    let overflow = || format!("dims {dims:?} overflow the byte size");
    inner
        .checked_mul(format.block_bytes())
        .ok_or_else(overflow)?;
    let row_bytes = format.row_bytes(inner).map_err(|e| e.to_string())?;
    row_bytes.checked_mul(rows).ok_or_else(overflow)
}

/// An open GGUF file: metadata plus a shared read-only map of the data.
pub struct GgufFile {
    pub path: PathBuf,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorEntry>,
    /// Tensors in a format the kernels do not run, with why: an error only
    /// if the model uses them ([`GgufFile::entry`] names the format).
    unsupported: HashMap<String, String>,
    map: Arc<Mmap>,
    file: Arc<std::fs::File>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Open and validate a GGUF file (header, tensor bounds, formats).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| ModelError::Io {
            path: path.clone(),
            source,
        };
        let file = std::fs::File::open(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                ModelError::NotFound(path.clone())
            } else {
                io(e)
            }
        })?;
        let bad = |reason: String| ModelError::BadGguf {
            path: path.clone(),
            reason,
        };
        let content = {
            let mut r = std::io::BufReader::new(&file);
            header_alignment(&mut r).map_err(bad)?;
            r.rewind().map_err(io)?;
            Content::read(&mut r).map_err(|e| bad(e.to_string()))?
        };
        // SAFETY: the file is opened read-only; like llama.cpp we assume model
        // files are not modified while mapped (they are written via rename).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let file_len = map.len();
        let mut tensors = HashMap::with_capacity(content.tensor_infos.len());
        let mut unsupported = HashMap::new();
        for (name, info) in &content.tensor_infos {
            let dims: Vec<usize> = info.shape.dims().iter().rev().copied().collect();
            let format = QuantFormat::from_ggml(info.ggml_dtype);
            let format = match format {
                Ok(f) => f,
                // Unsupported formats are only an error if the tensor is used.
                Err(e) => {
                    unsupported.insert(name.clone(), e.to_string());
                    continue;
                }
            };
            let len =
                tensor_len(format, &dims).map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
            let offset = content
                .tensor_data_offset
                .checked_add(info.offset)
                .and_then(|o| usize::try_from(o).ok())
                .ok_or_else(|| {
                    bad(format!(
                        "tensor `{name}`: offset {} lies beyond any file",
                        info.offset
                    ))
                })?;
            if offset.checked_add(len).is_none_or(|end| end > file_len) {
                return Err(bad(format!(
                    "tensor `{name}` ({len} bytes at {offset}) runs past the end of the file ({file_len} bytes); the file is truncated"
                )));
            }
            tensors.insert(
                name.clone(),
                TensorEntry {
                    format,
                    dims,
                    offset,
                    len,
                },
            );
        }
        Ok(Self {
            path,
            metadata: content.metadata,
            tensors,
            unsupported,
            map: Arc::new(map),
            file: Arc::new(file),
        })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Let the kernel drop the pages of bytes `offset..offset + len` of the
    /// mapping from this process (the whole pages inside the range; a
    /// no-op off Unix or on error). For tensors held in another form in
    /// memory (the tile layout): loading them read every page, and without
    /// this the resident size would count them twice. The bytes stay
    /// readable: a later read faults its page back in from the file.
    pub fn release(&self, offset: usize, len: usize) {
        #[cfg(unix)]
        {
            const PAGE: usize = 4096;
            let start = offset.next_multiple_of(PAGE);
            let end = offset.saturating_add(len).min(self.map.len()) / PAGE * PAGE;
            if end > start {
                // SAFETY: a read-only file mapping: dropping its pages loses
                // nothing (they are re-read from the file on access), and
                // the mapping stays valid for every borrow of it.
                let _ = unsafe {
                    self.map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        start,
                        end - start,
                    )
                };
            }
        }
        #[cfg(not(unix))]
        let _ = (offset, len);
    }

    pub fn file_size(&self) -> usize {
        self.map.len()
    }

    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors
            .get(name)
            .ok_or_else(|| match self.unsupported.get(name) {
                Some(why) => ModelError::BadTensor {
                    name: name.to_string(),
                    reason: why.clone(),
                },
                None => ModelError::MissingTensor(name.to_string()),
            })
    }

    pub fn tensor_bytes(&self, e: &TensorEntry) -> &[u8] {
        &self.map[e.offset..e.offset + e.len]
    }

    /// A copy of a tensor's bytes read from the file (not through the map,
    /// so a tensor that is converted at load time never becomes resident
    /// twice: the mapped pages are not touched).
    pub fn read_tensor(&self, e: &TensorEntry) -> Result<Vec<u8>> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            let mut buf = vec![0u8; e.len];
            self.file
                .read_exact_at(&mut buf, e.offset as u64)
                .map_err(|source| ModelError::Io {
                    path: self.path.clone(),
                    source,
                })?;
            Ok(buf)
        }
        #[cfg(not(unix))]
        {
            Ok(self.tensor_bytes(e).to_vec())
        }
    }

    /// A 2-D tensor as a matrix of `rows = dims[1]`, `cols = dims[0]`.
    pub fn matrix(&self, name: &str) -> Result<QMatrix<'_>> {
        let e = self.entry(name)?;
        if e.dims.len() != 2 {
            return Err(ModelError::BadTensor {
                name: name.into(),
                reason: format!("expected 2 dims, got {:?}", e.dims),
            });
        }
        QMatrix::new(e.format, e.dims[1], e.dims[0], self.tensor_bytes(e)).map_err(|err| {
            ModelError::BadTensor {
                name: name.into(),
                reason: err.to_string(),
            }
        })
    }

    /// A 1-D f32 tensor copied out (norm weights, biases: small).
    pub fn vector_f32(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let e = self.entry(name)?;
        if e.elems() != len {
            return Err(ModelError::BadTensor {
                name: name.into(),
                reason: format!("expected {len} elements, got {:?}", e.dims),
            });
        }
        let mut out = vec![0f32; len];
        crate::quant::QMatrix::new(e.format, 1, len, self.tensor_bytes(e))
            .map_err(|err| ModelError::BadTensor {
                name: name.into(),
                reason: err.to_string(),
            })?
            .dequantize_row(0, &mut out);
        Ok(out)
    }

    pub fn meta(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| ModelError::MissingMetadata(key.to_string()))
    }

    pub fn meta_u32(&self, key: &str) -> Result<u32> {
        let v = self.meta(key)?;
        let wide = match v {
            Value::U8(x) => Some(i128::from(*x)),
            Value::I8(x) => Some(i128::from(*x)),
            Value::U16(x) => Some(i128::from(*x)),
            Value::I16(x) => Some(i128::from(*x)),
            Value::U32(x) => Some(i128::from(*x)),
            Value::I32(x) => Some(i128::from(*x)),
            Value::U64(x) => Some(i128::from(*x)),
            Value::I64(x) => Some(i128::from(*x)),
            _ => None,
        };
        let bad = |reason: String| ModelError::BadGguf {
            path: self.path.clone(),
            reason,
        };
        let wide = wide.ok_or_else(|| bad(format!("metadata `{key}` is not an integer")))?;
        u32::try_from(wide).map_err(|_| {
            bad(format!(
                "metadata `{key}` is {wide}, outside 0..={}",
                u32::MAX
            ))
        })
    }

    pub fn meta_f32(&self, key: &str) -> Result<f32> {
        let v = self.meta(key)?;
        v.to_f32()
            .or_else(|_| v.to_f64().map(|x| x as f32))
            .map_err(|_| ModelError::BadGguf {
                path: self.path.clone(),
                reason: format!("metadata `{key}` is not a float"),
            })
    }

    pub fn meta_str(&self, key: &str) -> Result<&str> {
        self.meta(key)?
            .to_string()
            .map(|s| s.as_str())
            .map_err(|_| ModelError::BadGguf {
                path: self.path.clone(),
                reason: format!("metadata `{key}` is not a string"),
            })
    }
}
