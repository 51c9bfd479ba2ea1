//! Memory-mapped GGUF files.
//!
//! The header (metadata + tensor directory) is parsed with candle's reader; the
//! tensor data stays in the page cache through `mmap`, so loading a model costs
//! no copy and resident memory follows only the pages actually touched.

use crate::quant::{QMatrix, QuantFormat};
use crate::{ModelError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use memmap2::Mmap;
use std::collections::HashMap;
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
    pub fn elems(&self) -> usize {
        self.dims.iter().product()
    }
}

/// An open GGUF file: metadata plus a shared read-only map of the data.
pub struct GgufFile {
    pub path: PathBuf,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorEntry>,
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
            Content::read(&mut r).map_err(|e| bad(e.to_string()))?
        };
        // SAFETY: the file is opened read-only; like llama.cpp we assume model
        // files are not modified while mapped (they are written via rename).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let file_len = map.len();
        let mut tensors = HashMap::with_capacity(content.tensor_infos.len());
        for (name, info) in &content.tensor_infos {
            let dims: Vec<usize> = info.shape.dims().iter().rev().copied().collect();
            let format = QuantFormat::from_ggml(info.ggml_dtype);
            let format = match format {
                Ok(f) => f,
                // Unsupported formats are only an error if the tensor is used.
                Err(_) => continue,
            };
            let elems: usize = dims.iter().product();
            let inner = dims.first().copied().unwrap_or(1);
            let row_bytes = format
                .row_bytes(inner)
                .map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
            let len = row_bytes * (elems / inner.max(1));
            let offset = content.tensor_data_offset as usize + info.offset as usize;
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
            map: Arc::new(map),
            file: Arc::new(file),
        })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub fn file_size(&self) -> usize {
        self.map.len()
    }

    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
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
        v.to_u32()
            .or_else(|_| v.to_u64().map(|x| x as u32))
            .or_else(|_| v.to_i32().map(|x| x as u32))
            .map_err(|_| ModelError::BadGguf {
                path: self.path.clone(),
                reason: format!("metadata `{key}` is not an integer"),
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
