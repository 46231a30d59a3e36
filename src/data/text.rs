//! Plain UTF-8 text files, cut into documents per [`TextSplit`]:
//! - `File`: the whole file is one document (read when its turn comes);
//! - `Paragraph`: each run of non-blank lines is one document (lines joined with `\n`,
//!   streamed line by line). Empty files and blank-only paragraphs yield nothing.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::Arc;

use super::docs::{Content, Doc, Loc, TextSplit};
use crate::{Error, Result};

pub struct TextDocs {
    file: Arc<Path>,
    reader: BufReader<File>,
    split: TextSplit,
    paragraph: u64,
    line_no: u64,
    done: bool,
}

impl TextDocs {
    pub fn open(file: Arc<Path>, split: TextSplit) -> Result<Self> {
        let f = File::open(&file).map_err(|e| Error::io(&*file, e))?;
        Ok(Self { file, reader: BufReader::new(f), split, paragraph: 0, line_no: 0, done: false })
    }

    fn doc(&self, text: String, loc: Loc) -> Doc {
        Doc { content: Content::Text(text), file: self.file.clone(), loc }
    }

    fn whole_file(&mut self) -> Result<Option<Doc>> {
        let mut bytes = Vec::new();
        self.reader.read_to_end(&mut bytes).map_err(|e| Error::io(&*self.file, e))?;
        let text = String::from_utf8(bytes)
            .map_err(|e| Error::data(&*self.file, format!("not valid UTF-8 at byte {}", e.utf8_error().valid_up_to())))?;
        Ok((!text.trim().is_empty()).then(|| self.doc(text, Loc::File)))
    }

    fn next_paragraph(&mut self) -> Result<Option<Doc>> {
        let mut para = String::new();
        let mut line = Vec::new();
        loop {
            line.clear();
            let n = self.reader.read_until(b'\n', &mut line).map_err(|e| Error::io(&*self.file, e))?;
            if n == 0 {
                self.done = true;
                break;
            }
            self.line_no += 1;
            let s = std::str::from_utf8(&line)
                .map_err(|e| Error::data(&*self.file, format!("line {}: not valid UTF-8 ({e})", self.line_no)))?;
            let s = s.trim_end_matches(['\n', '\r']);
            if s.trim().is_empty() {
                if para.is_empty() {
                    continue;
                }
                break;
            }
            if !para.is_empty() {
                para.push('\n');
            }
            para.push_str(s);
        }
        if para.is_empty() {
            return Ok(None);
        }
        self.paragraph += 1;
        Ok(Some(self.doc(para, Loc::Paragraph(self.paragraph))))
    }
}

impl Iterator for TextDocs {
    type Item = Result<Doc>;
    fn next(&mut self) -> Option<Result<Doc>> {
        if self.done {
            return None;
        }
        let out = match self.split {
            TextSplit::File => {
                self.done = true;
                self.whole_file()
            }
            TextSplit::Paragraph => self.next_paragraph(),
        };
        if out.is_err() {
            self.done = true;
        }
        out.transpose()
    }
}
