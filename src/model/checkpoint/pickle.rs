//! A small, defensive pickle virtual machine.
//!
//! PyTorch checkpoints are Python pickles. This VM runs every opcode of protocols 0–5 that a
//! checkpoint can contain and builds an arena of [`Value`]s; it never imports or calls anything.
//! A call (`REDUCE`, `NEWOBJ`, `INST`, `OBJ`) is recorded as an [`Value::Object`] holding the
//! callable and its arguments, to be interpreted later (see `torch.rs`). The only callables it
//! understands itself are the containers whose later opcodes it must support
//! (`collections.OrderedDict`, `set`, `frozenset`).
//!
//! Values live in an arena and refer to each other by [`Id`], so the memo shares objects the way
//! Python's does (a dict stored in the memo and filled later is the same dict when fetched), a
//! `GET` costs nothing, and cyclic structures cannot blow up memory. Every malformed input ends
//! in an [`Error::Corrupt`]; nothing here panics.

use std::collections::HashMap;

use super::Error;

/// Index of a value in the [`Pickle`] arena.
pub type Id = usize;

/// Upper bound on arena size, far above any real checkpoint (a Wav2Lip file with optimizer
/// state builds about 20 000 values), so a hostile pickle cannot exhaust memory.
const MAX_VALUES: usize = 50_000_000;

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer too large for i64, as little-endian two's complement bytes (`LONG1`/`LONG4`).
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Id>),
    List(Vec<Id>),
    /// Insertion-ordered, like both `dict` and `OrderedDict`.
    Dict(Vec<(Id, Id)>),
    Set(Vec<Id>),
    /// A reference to `module.name` (from `GLOBAL` or `STACK_GLOBAL`).
    Global {
        module: String,
        name: String,
    },
    /// The result of calling `class` with `args` (a tuple id), plus what `BUILD`,
    /// `SETITEM(S)` and `APPEND(S)` added to it afterwards.
    Object {
        class: Id,
        args: Id,
        state: Option<Id>,
        items: Vec<(Id, Id)>,
        list: Vec<Id>,
    },
    /// A persistent id (`BINPERSID`): PyTorch's reference to a tensor storage.
    Persistent(Id),
}

/// A finished pickle: the arena and the id of the value `STOP` returned.
#[derive(Debug)]
pub struct Pickle {
    values: Vec<Value>,
    pub root: Id,
}

impl Pickle {
    pub fn get(&self, id: Id) -> &Value {
        // Ids are only created by the VM and always index the arena.
        &self.values[id]
    }

    /// Number of values in the arena; ids run from 0 to `len() - 1`.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn as_str(&self, id: Id) -> Option<&str> {
        match self.get(id) {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self, id: Id) -> Option<i64> {
        match self.get(id) {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    /// Elements of a tuple or list.
    pub fn as_seq(&self, id: Id) -> Option<&[Id]> {
        match self.get(id) {
            Value::Tuple(v) | Value::List(v) => Some(v),
            _ => None,
        }
    }

    /// `(module, name)` of a global reference.
    pub fn as_global(&self, id: Id) -> Option<(&str, &str)> {
        match self.get(id) {
            Value::Global { module, name } => Some((module, name)),
            _ => None,
        }
    }

    /// Entries of a dict (or of an object filled through `SETITEMS`).
    pub fn as_dict(&self, id: Id) -> Option<&[(Id, Id)]> {
        match self.get(id) {
            Value::Dict(v) => Some(v),
            _ => None,
        }
    }

    /// Looks up a string key in a dict.
    pub fn dict_get(&self, dict: Id, key: &str) -> Option<Id> {
        self.as_dict(dict)?
            .iter()
            .find(|(k, _)| self.as_str(*k) == Some(key))
            .map(|(_, v)| *v)
    }
}

/// Runs one pickle that starts at `data[0]`. Returns the pickle and the number of bytes it used
/// (legacy checkpoints are several pickles back to back).
pub fn load(data: &[u8]) -> Result<(Pickle, usize), Error> {
    let mut vm = Vm {
        data,
        pos: 0,
        values: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
    };
    let root = vm.run()?;
    Ok((
        Pickle {
            values: vm.values,
            root,
        },
        vm.pos,
    ))
}

struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    values: Vec<Value>,
    stack: Vec<Id>,
    marks: Vec<usize>,
    memo: HashMap<u64, Id>,
}

fn corrupt(msg: impl Into<String>) -> Error {
    Error::Corrupt(msg.into())
}

impl<'a> Vm<'a> {
    fn run(&mut self) -> Result<Id, Error> {
        loop {
            let at = self.pos;
            let op = self.byte()?;
            match op {
                0x80 => {
                    // PROTO
                    let proto = self.byte()?;
                    if proto > 5 {
                        return Err(corrupt(format!("unknown pickle protocol {proto}")));
                    }
                }
                0x95 => {
                    // FRAME: an 8-byte length; frames are only a read-ahead hint.
                    self.take(8)?;
                }
                b'.' => {
                    // STOP
                    return self.pop();
                }
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let top = *self
                        .stack
                        .last()
                        .ok_or_else(|| corrupt("DUP on empty stack"))?;
                    self.stack.push(top);
                }
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
                b'J' => {
                    let b = self.take(4)?;
                    self.push(Value::Int(i64::from(i32::from_le_bytes([
                        b[0], b[1], b[2], b[3],
                    ]))))?;
                }
                b'K' => {
                    let v = self.byte()?;
                    self.push(Value::Int(i64::from(v)))?;
                }
                b'M' => {
                    let b = self.take(2)?;
                    self.push(Value::Int(i64::from(u16::from_le_bytes([b[0], b[1]]))))?;
                }
                0x8a => {
                    // LONG1
                    let n = usize::from(self.byte()?);
                    let b = self.take(n)?.to_vec();
                    self.push(long_value(b))?;
                }
                0x8b => {
                    // LONG4
                    let n = self.len4()?;
                    let b = self.take(n)?.to_vec();
                    self.push(long_value(b))?;
                }
                b'I' => {
                    let line = self.line()?;
                    let v = match line.as_str() {
                        "00" => Value::Bool(false),
                        "01" => Value::Bool(true),
                        s => Value::Int(s.parse().map_err(|_| corrupt("bad INT literal"))?),
                    };
                    self.push(v)?;
                }
                b'L' => {
                    let line = self.line()?;
                    let s = line.trim_end_matches('L');
                    let v = s.parse().map_err(|_| corrupt("bad LONG literal"))?;
                    self.push(Value::Int(v))?;
                }
                b'F' => {
                    let line = self.line()?;
                    let v = line.parse().map_err(|_| corrupt("bad FLOAT literal"))?;
                    self.push(Value::Float(v))?;
                }
                b'G' => {
                    let b = self.take(8)?;
                    let mut a = [0u8; 8];
                    a.copy_from_slice(b);
                    self.push(Value::Float(f64::from_be_bytes(a)))?;
                }
                b'X' => {
                    let n = self.len4()?;
                    self.push_str(n)?;
                }
                0x8c => {
                    let n = usize::from(self.byte()?);
                    self.push_str(n)?;
                }
                0x8d => {
                    let n = self.len8()?;
                    self.push_str(n)?;
                }
                b'V' => {
                    // UNICODE (protocol 0): raw-unicode-escaped line; checkpoints only use ASCII.
                    let line = self.line()?;
                    self.push(Value::Str(line))?;
                }
                b'S' => {
                    // STRING (protocol 0): a quoted repr; keep the text between the quotes.
                    let line = self.line()?;
                    let s = line
                        .strip_prefix(['\'', '"'])
                        .and_then(|s| s.strip_suffix(['\'', '"']))
                        .ok_or_else(|| corrupt("bad STRING literal"))?;
                    self.push(Value::Str(s.to_string()))?;
                }
                b'T' => {
                    let n = self.len4()?;
                    self.push_bytes_as_str(n)?;
                }
                b'U' => {
                    let n = usize::from(self.byte()?);
                    self.push_bytes_as_str(n)?;
                }
                b'B' => {
                    let n = self.len4()?;
                    let b = self.take(n)?.to_vec();
                    self.push(Value::Bytes(b))?;
                }
                b'C' => {
                    let n = usize::from(self.byte()?);
                    let b = self.take(n)?.to_vec();
                    self.push(Value::Bytes(b))?;
                }
                0x8e | 0x96 => {
                    // BINBYTES8, BYTEARRAY8
                    let n = self.len8()?;
                    let b = self.take(n)?.to_vec();
                    self.push(Value::Bytes(b))?;
                }
                b']' => self.push(Value::List(Vec::new()))?,
                b')' => self.push(Value::Tuple(Vec::new()))?,
                b'}' => self.push(Value::Dict(Vec::new()))?,
                0x8f => self.push(Value::Set(Vec::new()))?,
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Value::List(items))?;
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Tuple(items))?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let at = self
                        .stack
                        .len()
                        .checked_sub(n)
                        .ok_or_else(|| corrupt("TUPLE on short stack"))?;
                    let items = self.stack.split_off(at);
                    self.push(Value::Tuple(items))?;
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let pairs = pairs(items)?;
                    self.push(Value::Dict(pairs))?;
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.push(Value::Set(items))?;
                }
                b'a' => {
                    let v = self.pop()?;
                    let target = self.top()?;
                    self.extend_list(target, vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    let target = self.top()?;
                    self.extend_list(target, items)?;
                }
                0x90 => {
                    let items = self.pop_mark()?;
                    let target = self.top()?;
                    self.extend_list(target, items)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let target = self.top()?;
                    self.extend_dict(target, vec![(k, v)])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let target = self.top()?;
                    self.extend_dict(target, pairs(items)?)?;
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.push(Value::Global { module, name })?;
                }
                0x93 => {
                    // STACK_GLOBAL
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Value::Str(module), Value::Str(name)) =
                        (self.values[module].clone(), self.values[name].clone())
                    else {
                        return Err(corrupt("STACK_GLOBAL needs two strings"));
                    };
                    self.push(Value::Global { module, name })?;
                }
                b'R' => {
                    let args = self.pop()?;
                    let class = self.pop()?;
                    self.call(class, args)?;
                }
                0x81 => {
                    // NEWOBJ: cls.__new__(cls, *args)
                    let args = self.pop()?;
                    let class = self.pop()?;
                    self.call(class, args)?;
                }
                0x92 => {
                    // NEWOBJ_EX: keyword arguments are dropped.
                    self.pop()?;
                    let args = self.pop()?;
                    let class = self.pop()?;
                    self.call(class, args)?;
                }
                b'i' => {
                    // INST (protocol 0)
                    let module = self.line()?;
                    let name = self.line()?;
                    let items = self.pop_mark()?;
                    let class = self.alloc(Value::Global { module, name })?;
                    let args = self.alloc(Value::Tuple(items))?;
                    self.call(class, args)?;
                }
                b'o' => {
                    // OBJ (protocol 1)
                    let mut items = self.pop_mark()?;
                    if items.is_empty() {
                        return Err(corrupt("OBJ without a class"));
                    }
                    let class = items.remove(0);
                    let args = self.alloc(Value::Tuple(items))?;
                    self.call(class, args)?;
                }
                b'b' => {
                    // BUILD: only objects keep their state; on anything else it is ignored,
                    // as no tensor data ever hides there.
                    let state = self.pop()?;
                    let target = self.top()?;
                    if let Value::Object { state: s, .. } = &mut self.values[target] {
                        *s = Some(state);
                    }
                }
                b'P' => {
                    let line = self.line()?;
                    let pid = self.alloc(Value::Str(line))?;
                    self.push(Value::Persistent(pid))?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    self.push(Value::Persistent(pid))?;
                }
                b'p' => {
                    let idx = self.line()?.parse().map_err(|_| corrupt("bad PUT index"))?;
                    self.memoize(idx)?;
                }
                b'q' => {
                    let idx = u64::from(self.byte()?);
                    self.memoize(idx)?;
                }
                b'r' => {
                    let idx = self.len4()? as u64;
                    self.memoize(idx)?;
                }
                0x94 => {
                    let idx = self.memo.len() as u64;
                    self.memoize(idx)?;
                }
                b'g' => {
                    let idx = self.line()?.parse().map_err(|_| corrupt("bad GET index"))?;
                    self.fetch(idx)?;
                }
                b'h' => {
                    let idx = u64::from(self.byte()?);
                    self.fetch(idx)?;
                }
                b'j' => {
                    let idx = self.len4()? as u64;
                    self.fetch(idx)?;
                }
                _ => {
                    return Err(corrupt(format!(
                        "unsupported pickle opcode 0x{op:02x} at byte {at}"
                    )))
                }
            }
        }
    }

    fn byte(&mut self) -> Result<u8, Error> {
        let b = *self
            .data
            .get(self.pos)
            .ok_or_else(|| Error::PickleEnded { at: self.pos })?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let data = self.data;
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or(Error::PickleEnded { at: self.pos })?;
        let s = &data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn len4(&mut self) -> Result<usize, Error> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    fn len8(&mut self) -> Result<usize, Error> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        usize::try_from(u64::from_le_bytes(a)).map_err(|_| corrupt("length does not fit"))
    }

    /// A newline-terminated text argument (protocol 0 opcodes and `GLOBAL`).
    fn line(&mut self) -> Result<String, Error> {
        let rest = &self.data[self.pos.min(self.data.len())..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(Error::PickleEnded { at: self.pos })?;
        let s = std::str::from_utf8(&rest[..n])
            .map_err(|_| corrupt("non-UTF-8 text in pickle"))?
            .to_string();
        self.pos += n + 1;
        Ok(s)
    }

    fn alloc(&mut self, v: Value) -> Result<Id, Error> {
        if self.values.len() >= MAX_VALUES {
            return Err(corrupt("pickle holds too many objects"));
        }
        self.values.push(v);
        Ok(self.values.len() - 1)
    }

    fn push(&mut self, v: Value) -> Result<(), Error> {
        let id = self.alloc(v)?;
        self.stack.push(id);
        Ok(())
    }

    fn push_str(&mut self, n: usize) -> Result<(), Error> {
        let b = self.take(n)?;
        let s = std::str::from_utf8(b)
            .map_err(|_| corrupt("invalid UTF-8 string in pickle"))?
            .to_string();
        self.push(Value::Str(s))
    }

    /// Python 2 `str` (BINSTRING / SHORT_BINSTRING): text when it is valid UTF-8, else bytes.
    fn push_bytes_as_str(&mut self, n: usize) -> Result<(), Error> {
        let b = self.take(n)?.to_vec();
        match String::from_utf8(b) {
            Ok(s) => self.push(Value::Str(s)),
            Err(e) => self.push(Value::Bytes(e.into_bytes())),
        }
    }

    fn pop(&mut self) -> Result<Id, Error> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return Err(corrupt("pop across a MARK"));
        }
        self.stack
            .pop()
            .ok_or_else(|| corrupt("pop from empty stack"))
    }

    fn top(&self) -> Result<Id, Error> {
        self.stack
            .last()
            .copied()
            .ok_or_else(|| corrupt("empty stack"))
    }

    fn pop_mark(&mut self) -> Result<Vec<Id>, Error> {
        let m = self.marks.pop().ok_or_else(|| corrupt("missing MARK"))?;
        if m > self.stack.len() {
            return Err(corrupt("MARK beyond stack"));
        }
        Ok(self.stack.split_off(m))
    }

    fn memoize(&mut self, idx: u64) -> Result<(), Error> {
        let top = self.top()?;
        if self.memo.len() >= MAX_VALUES {
            return Err(corrupt("pickle memo too large"));
        }
        self.memo.insert(idx, top);
        Ok(())
    }

    fn fetch(&mut self, idx: u64) -> Result<(), Error> {
        let id = *self
            .memo
            .get(&idx)
            .ok_or_else(|| corrupt(format!("memo key {idx} missing")))?;
        self.stack.push(id);
        Ok(())
    }

    fn extend_list(&mut self, target: Id, items: Vec<Id>) -> Result<(), Error> {
        match &mut self.values[target] {
            Value::List(v) | Value::Set(v) => v.extend(items),
            Value::Object { list, .. } => list.extend(items),
            _ => return Err(corrupt("APPEND to a non-list")),
        }
        Ok(())
    }

    fn extend_dict(&mut self, target: Id, items: Vec<(Id, Id)>) -> Result<(), Error> {
        match &mut self.values[target] {
            Value::Dict(v) => v.extend(items),
            Value::Object { items: v, .. } => v.extend(items),
            _ => return Err(corrupt("SETITEM on a non-dict")),
        }
        Ok(())
    }

    /// REDUCE / NEWOBJ: containers become containers, everything else an [`Value::Object`].
    fn call(&mut self, class: Id, args: Id) -> Result<(), Error> {
        let v = match &self.values[class] {
            Value::Global { module, name } => match (module.as_str(), name.as_str()) {
                ("collections", "OrderedDict") => Value::Dict(Vec::new()),
                ("builtins" | "__builtin__", "set" | "frozenset") => {
                    let items = match &self.values[args] {
                        Value::Tuple(a) => match a.first().map(|&i| &self.values[i]) {
                            Some(Value::List(l) | Value::Tuple(l) | Value::Set(l)) => l.clone(),
                            _ => Vec::new(),
                        },
                        _ => Vec::new(),
                    };
                    Value::Set(items)
                }
                _ => object(class, args),
            },
            _ => object(class, args),
        };
        self.push(v)
    }
}

fn object(class: Id, args: Id) -> Value {
    Value::Object {
        class,
        args,
        state: None,
        items: Vec::new(),
        list: Vec::new(),
    }
}

fn pairs(items: Vec<Id>) -> Result<Vec<(Id, Id)>, Error> {
    if items.len() % 2 != 0 {
        return Err(corrupt("odd number of dict items"));
    }
    Ok(items.chunks_exact(2).map(|c| (c[0], c[1])).collect())
}

/// `LONG1`/`LONG4` payload: little-endian two's complement of any length.
fn long_value(b: Vec<u8>) -> Value {
    if b.len() <= 8 {
        let fill = if b.last().is_some_and(|&x| x & 0x80 != 0) {
            0xff
        } else {
            0
        };
        let mut a = [fill; 8];
        a[..b.len()].copy_from_slice(&b);
        Value::Int(i64::from_le_bytes(a))
    } else {
        Value::BigInt(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long1_sign_extends_and_keeps_big_values() {
        assert_eq!(long_value(vec![0xff]), Value::Int(-1));
        assert_eq!(long_value(vec![0x00, 0x01]), Value::Int(256));
        assert_eq!(long_value(vec![]), Value::Int(0));
        // PyTorch's legacy magic number does not fit an i64.
        let magic = vec![0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];
        assert_eq!(long_value(magic.clone()), Value::BigInt(magic));
    }

    #[test]
    fn memo_shares_containers_filled_after_put() {
        // pickle.dumps({'a': [1]}, protocol=2) with the list put in the memo before filling:
        // \x80\x02 } q\x00 X\x01\x00\x00\x00a ] q\x01 K\x01 a s .
        let p = b"\x80\x02}q\x00X\x01\x00\x00\x00a]q\x01K\x01as.";
        let (pk, used) = load(p).unwrap();
        assert_eq!(used, p.len());
        let list = pk.dict_get(pk.root, "a").unwrap();
        assert_eq!(pk.as_seq(list).map(<[Id]>::len), Some(1));
    }

    #[test]
    fn truncated_and_garbage_inputs_are_errors() {
        let p = b"\x80\x02}q\x00X\x01\x00\x00\x00a]q\x01K\x01as.";
        for n in 0..p.len() {
            assert!(load(&p[..n]).is_err(), "prefix of {n} bytes");
        }
        assert!(load(b"\xff").is_err());
        assert!(load(b"h\x05").is_err()); // GET of a missing memo key
        assert!(load(b"(.").is_err()); // STOP across a mark
    }
}
