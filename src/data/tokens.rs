//! Raw token files (nanoGPT's `.bin`): a flat array of u16 or u32 little-endian token
//! ids with no header. The file is one continuous token stream (documents are already
//! separated by whatever EOS the producer wrote), read in pieces of [`PIECE`] tokens.
//! Several files are read one after the other as one stream.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;
use std::sync::Arc;

use super::docs::{Content, Doc, Loc};
use super::source::TokenWidth;
use crate::{Error, Result};

/// Tokens per piece yielded (1 Mi tokens: 2-4 MiB read at a time).
pub const PIECE: usize = 1 << 20;

pub struct TokenFileDocs {
    file: Arc<Path>,
    reader: BufReader<File>,
    width: TokenWidth,
    total: u64,
    offset: u64,
    buf: Vec<u8>,
}

impl TokenFileDocs {
    pub fn open(file: Arc<Path>, width: TokenWidth) -> Result<Self> {
        let f = File::open(&file).map_err(|e| Error::io(&*file, e))?;
        let len = f.metadata().map_err(|e| Error::io(&*file, e))?.len();
        let w = width.bytes() as u64;
        if len % w != 0 {
            return Err(Error::data(
                &*file,
                format!(
                    "size {len} bytes is not a multiple of {w} bytes, the width of one {width:?} token; \
                     wrong token width, or a truncated file?"
                ),
            ));
        }
        Ok(Self { file, reader: BufReader::new(f), width, total: len / w, offset: 0, buf: Vec::new() })
    }

    fn read_piece(&mut self) -> Result<Doc> {
        let n = (self.total - self.offset).min(PIECE as u64) as usize;
        let w = self.width.bytes();
        self.buf.resize(n * w, 0);
        self.reader.read_exact(&mut self.buf).map_err(|e| Error::io(&*self.file, e))?;
        let ids: Vec<u32> = match self.width {
            TokenWidth::U16 => self.buf.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect(),
            TokenWidth::U32 => self.buf.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        };
        let doc = Doc { content: Content::Stream(ids), file: self.file.clone(), loc: Loc::Token(self.offset) };
        self.offset += n as u64;
        Ok(doc)
    }
}

impl Iterator for TokenFileDocs {
    type Item = Result<Doc>;
    fn next(&mut self) -> Option<Result<Doc>> {
        if self.offset >= self.total {
            return None;
        }
        let piece = self.read_piece();
        if piece.is_err() {
            self.offset = self.total;
        }
        Some(piece)
    }
}
