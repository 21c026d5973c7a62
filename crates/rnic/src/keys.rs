//! The key table of one namespace: direct memory regions, indirect keys and
//! aliases, and the translation of (key, address, length) into host memory
//! that every data access goes through.
//!
//! - A **direct** key is an MR: one range of a memfd the client passed, or
//!   several laid end to end (a scattered region, `mem::RegionMemory`).
//! - An **indirect** key (like a UMR mkey) is created once, with no memory,
//!   then bound by a send-queue work request to a range of an existing MR
//!   or to a list of ranges of several MRs (KLM style), and invalidated by
//!   another. Each bind or invalidation gives the key a new generation.
//! - An **alias** lets another client reach a key it was granted
//!   (cross-client, as a DPU agent reaches host memory). The alias
//!   records its target's generation when created; it translates only while
//!   the target still exists with that generation, still belongs to the
//!   same owner and still grants the alias owner access. A rebind, a
//!   revocation or the owner's death makes it stale: refused, never used.
//! - A **foreign alias** does the same for a key of another namespace of
//!   this rnicd. It cannot look the target up in its own table, so it holds
//!   weak references to what it was made for ([`Export`]): the MR, or the
//!   binding of that generation (every bind makes a new one), and the
//!   grant. A rebind, invalidation, revocation, deregistration, the owner's
//!   death and the closing of its namespace all drop the strong side, and
//!   the alias turns stale at once without either table knowing the other.
//!
//! Bindings never point at MRs strongly: a binding entry holds a `Weak`, so
//! deregistering an MR ends every binding through it at once.
//!
//! Atomicity against a rebind: the engine runs on one thread and resolves a
//! packet's whole range in one call, so a packet sees one binding. A
//! message of several packets records its key's generation at its first
//! packet (`generation`); a later packet that finds another generation is
//! refused (remote access error), so a message never lands partly in the old
//! and partly in the new binding.

use std::sync::{Arc, Weak};

pub use crate::mem::Span;
use crate::objects::{ClientId, IdMap, Mr};
use crate::types::access;

/// A resolved range: its host memory, and the MRs it lies in that were
/// reached through weak references (a binding's entries, a foreign alias's
/// target). Those have their last owner elsewhere: another namespace's
/// table, or a closed namespace's objects being released on a thread of
/// their own (`daemon::release_off_loop`). Holding them keeps the memory
/// mapped until the packet's data has been copied.
pub struct Resolved {
    span: Span,
    _keep: Vec<Arc<Mr>>,
}

impl std::ops::Deref for Resolved {
    type Target = Span;

    fn deref(&self) -> &Span {
        &self.span
    }
}

/// Most entries of one binding (a KLM list): 8 in the WQE's SGE array and
/// 16 more in its inline area.
pub const MAX_KLM: usize = 24;
/// Most indirect keys and aliases one namespace holds.
pub const MAX_INDIRECT: usize = 1 << 20;

/// Whether an MR with `mr_access` may be bound with `access`: an MR grants
/// an indirect key at most its own rights, except that an MR registered for
/// memory windows (MW_BIND) lends remote rights it does not have itself,
/// write and atomic ones only if it has local write (IBA o10-36.2.1).
fn bind_allowed(mr_access: u32, access: u32) -> bool {
    if mr_access & access == access {
        return true;
    }
    mr_access & access::MW_BIND != 0
        && (access & (access::REMOTE_WRITE | access::REMOTE_ATOMIC | access::LOCAL_WRITE) == 0 || mr_access & access::LOCAL_WRITE != 0)
}

/// One range of a binding: `len` bytes of `mr` at its address `va`,
/// `start` bytes into the bound range.
pub struct Entry {
    pub mr: Weak<Mr>,
    pub va: u64,
    pub len: u64,
    pub start: u64,
}

/// What an indirect key currently points at (shared with foreign aliases
/// of it, which hold it weakly: a new bind replaces it).
pub struct Binding {
    pub iova: u64,
    pub len: u64,
    pub access: u32,
    pub entries: Vec<Entry>,
    /// A memory window's binding lends rights its MRs lack themselves
    /// (MW_BIND): their memory is reached as the MR owner's local access.
    pub lent: bool,
}

impl Binding {
    /// The span of [va, va+len), adding to `keep` each MR it lies in.
    fn resolve(&self, va: u64, len: u64, need: u32, keep: &mut Vec<Arc<Mr>>) -> Option<Span> {
        if self.access & need != need {
            return None;
        }
        let off = va.checked_sub(self.iova)?;
        let end = off.checked_add(len)?;
        if end > self.len {
            return None;
        }
        if len == 0 {
            return Some(Span::Many(Vec::new()));
        }
        // First entry holding `off` (entries are sorted by start, contiguous).
        let mut i = self.entries.partition_point(|e| e.start + e.len <= off);
        let mut pieces = Vec::new();
        let mut at = off;
        while at < end {
            let e = self.entries.get(i)?;
            let mr = e.mr.upgrade()?;
            let n = (e.start + e.len).min(end) - at;
            let mr_need = if !self.lent {
                need
            } else if need & (access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0 {
                access::LOCAL_WRITE
            } else {
                0
            };
            mr.translate(mr.pd, e.va + (at - e.start), n, mr_need)?.push_to(n as usize, &mut pieces);
            keep.push(mr);
            at += n;
            i += 1;
        }
        Some(if pieces.len() == 1 { Span::One(pieces[0].0) } else { Span::Many(pieces) })
    }
}

/// What an alias reaches.
pub enum AliasTarget {
    Direct(Weak<Mr>),
    Indirect {
        key: u32,
        generation: u64,
    },
    /// A key of another namespace.
    Foreign(Export),
}

/// What an alias in another namespace holds of the key it reaches: weak
/// references that die with the binding (rebind, invalidation), the MR,
/// the grant (revocation) or the owner (its death, its namespace closing).
pub struct Export {
    pub memory: ExportedMemory,
    pub grant: Weak<Grant>,
}

pub enum ExportedMemory {
    Mr(Weak<Mr>),
    Binding(Weak<Binding>),
}

impl Export {
    fn resolve(&self, va: u64, len: u64, need: u32, keep: &mut Vec<Arc<Mr>>) -> Option<Span> {
        self.grant.upgrade()?;
        match &self.memory {
            ExportedMemory::Mr(w) => {
                let mr = w.upgrade()?;
                let span = mr.translate(mr.pd, va, len, need)?;
                keep.push(mr);
                Some(span)
            }
            ExportedMemory::Binding(w) => w.upgrade()?.resolve(va, len, need, keep),
        }
    }

    fn live(&self) -> bool {
        self.grant.strong_count() > 0
            && match &self.memory {
                ExportedMemory::Mr(w) => w.strong_count() > 0,
                ExportedMemory::Binding(w) => w.strong_count() > 0,
            }
    }
}

/// A client's permission to alias a key; foreign aliases hold it weakly,
/// so taking it back (or the key going) makes them stale.
pub struct Grant {
    pub grantee: ClientId,
}

pub enum IndirectKind {
    Indirect { max_entries: usize, binding: Option<Arc<Binding>> },
    Alias { target_key: u32, target_owner: ClientId, target: AliasTarget },
}

/// An indirect key or an alias (both created by a control call, neither
/// owning memory).
pub struct IndirectKey {
    pub owner: ClientId,
    pub pd: u32,
    pub generation: u64,
    pub kind: IndirectKind,
}

/// Why a bind work request failed (its completion status says which).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindError {
    /// No such key, not the QP owner's, not indirect, or not in the QP's PD.
    NotOwned,
    /// More entries than the key was created for (or than MAX_KLM).
    TooLong,
    /// An entry outside its MR, an MR not the caller's or in another PD,
    /// access the MRs do not grant, an MR a window's bind may not use
    /// (no MW_BIND), or an empty / overflowing range.
    BadRange,
}

/// All keys of a namespace.
#[derive(Default)]
pub struct Keys {
    pub direct: IdMap<Arc<Mr>>,
    pub indirect: IdMap<IndirectKey>,
    /// Clients a key's owner allowed to alias it.
    pub grants: IdMap<Vec<Arc<Grant>>>,
    /// Generations are unique in the namespace (never reused), so an alias
    /// can tell a rebound or re-created key from the one it was made for.
    next_generation: u64,
}

impl Keys {
    pub fn contains(&self, key: u32) -> bool {
        self.direct.contains_key(&key) || self.indirect.contains_key(&key)
    }

    /// Whether `client` may alias `key`.
    pub fn granted(&self, key: u32, client: ClientId) -> bool {
        self.grants.get(&key).is_some_and(|g| g.iter().any(|x| x.grantee == client))
    }

    /// What a foreign alias of `owner`'s `key` for `grantee` holds, and the
    /// range it reaches now; None (with the reason) if it may not be made.
    pub fn export(&self, owner: ClientId, key: u32, grantee: ClientId) -> Result<(Export, (u64, u64, u32)), String> {
        if self.owner(key) != Some(owner) {
            return Err(format!("client {owner} has no key {key:#x}"));
        }
        let grant = self.grants.get(&key).and_then(|g| g.iter().find(|x| x.grantee == grantee));
        let Some(grant) = grant else { return Err(format!("client {owner} did not grant key {key:#x} to this client")) };
        let memory = match (self.direct.get(&key), self.indirect.get(&key).map(|k| &k.kind)) {
            (Some(mr), _) => ExportedMemory::Mr(Arc::downgrade(mr)),
            (None, Some(IndirectKind::Indirect { binding: Some(b), .. })) => ExportedMemory::Binding(Arc::downgrade(b)),
            _ => return Err(format!("key {key:#x} is not bound to memory")),
        };
        let extent = self.extent(key).ok_or_else(|| format!("key {key:#x} has no memory"))?;
        Ok((Export { memory, grant: Arc::downgrade(grant) }, extent))
    }

    pub fn new_generation(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }

    /// Host memory of [va, va+len) through `key` in protection domain `pd`
    /// with access `need`; None if the key does not grant exactly that now.
    pub fn resolve(&self, key: u32, pd: u32, va: u64, len: u64, need: u32) -> Option<Resolved> {
        let mut keep = Vec::new();
        let span = self.resolve_keeping(key, pd, va, len, need, &mut keep)?;
        Some(Resolved { span, _keep: keep })
    }

    /// `resolve`'s span, adding to `keep` each MR it reached through a weak
    /// reference. (An MR in this table stays mapped while the packet is
    /// handled: only the event loop changes the table.)
    fn resolve_keeping(&self, key: u32, pd: u32, va: u64, len: u64, need: u32, keep: &mut Vec<Arc<Mr>>) -> Option<Span> {
        if let Some(mr) = self.direct.get(&key) {
            return mr.translate(pd, va, len, need);
        }
        let k = self.indirect.get(&key)?;
        if k.pd != pd {
            return None;
        }
        match &k.kind {
            IndirectKind::Indirect { binding, .. } => binding.as_ref()?.resolve(va, len, need, keep),
            IndirectKind::Alias { target: AliasTarget::Foreign(e), .. } => e.resolve(va, len, need, keep),
            IndirectKind::Alias { target_key, target_owner, target } => {
                if !self.granted(*target_key, k.owner) {
                    return None;
                }
                match target {
                    AliasTarget::Foreign(_) => None,
                    AliasTarget::Direct(w) => {
                        let mr = self.direct.get(target_key).filter(|m| std::ptr::eq(Arc::as_ptr(m), w.as_ptr()))?;
                        if mr.owner != *target_owner {
                            return None;
                        }
                        mr.translate(mr.pd, va, len, need)
                    }
                    AliasTarget::Indirect { generation, .. } => {
                        let t = self.indirect.get(target_key).filter(|t| t.generation == *generation && t.owner == *target_owner)?;
                        match &t.kind {
                            IndirectKind::Indirect { binding: Some(b), .. } => b.resolve(va, len, need, keep),
                            _ => None,
                        }
                    }
                }
            }
        }
    }

    /// The key's generation (0 for direct MRs, which never rebind): a
    /// message records it at its first packet and checks it on the others.
    pub fn generation(&self, key: u32) -> u64 {
        self.indirect.get(&key).map_or(0, |k| k.generation)
    }

    /// Whether `key` (an alias) still reaches what it was made for.
    pub fn alias_live(&self, key: u32) -> bool {
        self.indirect.get(&key).is_some_and(|k| matches!(k.kind, IndirectKind::Alias { .. })) && self.resolve_any(key)
    }

    fn resolve_any(&self, key: u32) -> bool {
        let Some(k) = self.indirect.get(&key) else { return false };
        let IndirectKind::Alias { target_key, target_owner, target } = &k.kind else { return false };
        if let AliasTarget::Foreign(e) = target {
            return e.live();
        }
        if !self.granted(*target_key, k.owner) {
            return false;
        }
        match target {
            AliasTarget::Foreign(_) => false,
            AliasTarget::Direct(w) => {
                self.direct.get(target_key).is_some_and(|m| std::ptr::eq(Arc::as_ptr(m), w.as_ptr()) && m.owner == *target_owner)
            }
            AliasTarget::Indirect { generation, .. } => self.indirect.get(target_key).is_some_and(|t| {
                t.generation == *generation && t.owner == *target_owner && matches!(t.kind, IndirectKind::Indirect { binding: Some(_), .. })
            }),
        }
    }

    /// Binds indirect key `key` (owned by `client`, in `pd`) to the ranges
    /// `entries` (address, length, MR key), seen at `iova` with `access`.
    pub fn bind(
        &mut self,
        client: ClientId,
        pd: u32,
        key: u32,
        iova: u64,
        access_flags: u32,
        entries: &[(u64, u64, u32)],
    ) -> Result<(), BindError> {
        let max = match self.indirect.get(&key) {
            Some(IndirectKey { owner, pd: kpd, kind: IndirectKind::Indirect { max_entries, .. }, .. })
                if *owner == client && *kpd == pd =>
            {
                *max_entries
            }
            _ => return Err(BindError::NotOwned),
        };
        if entries.len() > max || entries.len() > MAX_KLM {
            return Err(BindError::TooLong);
        }
        if entries.is_empty() || access_flags & !access::ALL != 0 {
            return Err(BindError::BadRange);
        }
        let mut out = Vec::with_capacity(entries.len());
        let mut start = 0u64;
        let mut lent = false;
        for &(va, len, mr_key) in entries {
            let mr = self.direct.get(&mr_key).ok_or(BindError::BadRange)?;
            if mr.owner != client || mr.pd != pd || len == 0 || !bind_allowed(mr.access, access_flags) {
                return Err(BindError::BadRange);
            }
            lent |= mr.access & access_flags != access_flags;
            let off = va.checked_sub(mr.iova).ok_or(BindError::BadRange)?;
            if off.checked_add(len).is_none_or(|e| e > mr.len) {
                return Err(BindError::BadRange);
            }
            out.push(Entry { mr: Arc::downgrade(mr), va, len, start });
            start = start.checked_add(len).ok_or(BindError::BadRange)?;
        }
        if iova.checked_add(start).is_none() {
            return Err(BindError::BadRange);
        }
        let generation = self.new_generation();
        let k = self.indirect.get_mut(&key).ok_or(BindError::NotOwned)?;
        k.generation = generation;
        k.kind = IndirectKind::Indirect {
            max_entries: max,
            binding: Some(Arc::new(Binding { iova, len: start, access: access_flags, entries: out, lent })),
        };
        Ok(())
    }

    /// A memory window's bind: as `bind`, and every MR must be registered
    /// for windows (MW_BIND, IBA C10-73) even if it has the rights itself.
    pub fn bind_window(
        &mut self,
        client: ClientId,
        pd: u32,
        key: u32,
        iova: u64,
        access_flags: u32,
        entries: &[(u64, u64, u32)],
    ) -> Result<(), BindError> {
        if entries.iter().any(|(_, _, mr_key)| self.direct.get(mr_key).is_none_or(|mr| mr.access & access::MW_BIND == 0)) {
            return Err(BindError::BadRange);
        }
        self.bind(client, pd, key, iova, access_flags, entries)
    }

    /// A memory window's new key (the consumer's `ibv_inc_rkey`): indirect
    /// key `key` of `client` in `pd` moves to `new_key`, which differs only
    /// in its low byte and is free. The old key grants nothing any more.
    pub fn rename(&mut self, client: ClientId, pd: u32, key: u32, new_key: u32) -> Result<(), BindError> {
        if new_key == key {
            return Ok(());
        }
        match self.indirect.get(&key) {
            Some(k) if k.owner == client && k.pd == pd && matches!(k.kind, IndirectKind::Indirect { .. }) => {}
            _ => return Err(BindError::NotOwned),
        }
        if new_key >> 8 != key >> 8 || self.contains(new_key) || self.grants.contains_key(&key) {
            return Err(BindError::BadRange);
        }
        let k = self.indirect.remove(&key).ok_or(BindError::NotOwned)?;
        self.indirect.insert(new_key, k);
        Ok(())
    }

    /// Invalidates indirect key `key` of `client` in `pd`: it grants nothing until the next bind.
    pub fn invalidate(&mut self, client: ClientId, pd: u32, key: u32) -> Result<(), BindError> {
        let generation = self.new_generation();
        match self.indirect.get_mut(&key) {
            Some(k) if k.owner == client && k.pd == pd => match &mut k.kind {
                IndirectKind::Indirect { binding, .. } => {
                    *binding = None;
                    k.generation = generation;
                    Ok(())
                }
                IndirectKind::Alias { .. } => Err(BindError::NotOwned),
            },
            _ => Err(BindError::NotOwned),
        }
    }

    /// SEND with invalidate from the peer: the key stops granting remote access.
    pub fn remote_invalidate(&mut self, key: u32, pd: u32) {
        if let Some(mr) = self.direct.get(&key) {
            if mr.pd == pd {
                mr.invalidated.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            return;
        }
        let owner = match self.indirect.get(&key) {
            Some(k) if k.pd == pd => k.owner,
            _ => return,
        };
        let _ = self.invalidate(owner, pd, key);
    }

    /// Removes a key and whatever was granted on it.
    pub fn remove(&mut self, key: u32) {
        self.direct.remove(&key);
        self.indirect.remove(&key);
        self.grants.remove(&key);
    }

    /// A client went away: its keys go (aliases of them turn stale), and so
    /// do its aliases and grants to it.
    pub fn client_gone(&mut self, client: ClientId) -> Vec<Arc<Mr>> {
        let gone = crate::objects::take_where(&mut self.direct, |m| m.owner == client);
        self.indirect.retain(|_, k| k.owner != client);
        let (direct, indirect) = (&self.direct, &self.indirect);
        self.grants.retain(|key, g| {
            g.retain(|x| x.grantee != client);
            direct.contains_key(key) || indirect.contains_key(key)
        });
        gone
    }

    /// The owner of a key (direct or indirect), if any.
    pub fn owner(&self, key: u32) -> Option<ClientId> {
        self.direct.get(&key).map(|m| m.owner).or_else(|| self.indirect.get(&key).map(|k| k.owner))
    }

    /// The range, access and generation a key currently grants (for aliases
    /// made of it): (iova, len, access).
    pub fn extent(&self, key: u32) -> Option<(u64, u64, u32)> {
        if let Some(m) = self.direct.get(&key) {
            return Some((m.iova, m.len, m.access));
        }
        match &self.indirect.get(&key)?.kind {
            IndirectKind::Indirect { binding: Some(b), .. } => Some((b.iova, b.len, b.access)),
            _ => None,
        }
    }
}

/// Copies `out.len()` bytes of the message described by `sges`, starting at
/// message offset `off`, into `out` (local read: no access bit needed).
pub fn gather(keys: &Keys, pd: u32, sges: &[crate::ring::Sge], mut off: u64, out: &mut [u8]) -> Result<(), crate::types::WcStatus> {
    use crate::types::WcStatus;
    let mut done = 0usize;
    for s in sges {
        if done == out.len() {
            break;
        }
        let sl = s.length as u64;
        if off >= sl {
            off -= sl;
            continue;
        }
        let n = ((sl - off) as usize).min(out.len() - done);
        let span = keys.resolve(s.lkey, pd, s.addr + off, n as u64, 0).ok_or(WcStatus::LocProtErr)?;
        // SAFETY: resolved for n bytes just now; out has room.
        unsafe { span.read(&mut out[done..done + n]) };
        done += n;
        off = 0;
    }
    if done != out.len() {
        return Err(WcStatus::LocLenErr);
    }
    Ok(())
}

/// Where `len` bytes of the message described by `sges`, from message
/// offset `off`, lie when they are one piece of one direct memory region:
/// the region (which keeps them mapped) and their host address. None when
/// they cross SGEs, runs or keys of other kinds, or do not resolve (the
/// caller then copies them with `gather`, which reports the error).
pub fn in_place(keys: &Keys, pd: u32, sges: &[crate::ring::Sge], mut off: u64, len: usize) -> Option<(Arc<Mr>, *const u8)> {
    for s in sges {
        let sl = s.length as u64;
        if off >= sl {
            off -= sl;
            continue;
        }
        if sl - off < len as u64 {
            return None;
        }
        let mr = keys.direct.get(&s.lkey)?;
        let p = mr.translate(pd, s.addr.checked_add(off)?, len as u64, 0)?.contiguous()?;
        return Some((mr.clone(), p as *const u8));
    }
    None
}

/// Writes `data` into the message buffer `sges` at offset `off` (needs LOCAL_WRITE).
pub fn scatter(keys: &Keys, pd: u32, sges: &[crate::ring::Sge], mut off: u64, data: &[u8]) -> Result<(), crate::types::WcStatus> {
    use crate::types::WcStatus;
    let mut done = 0usize;
    for s in sges {
        if done == data.len() {
            break;
        }
        let sl = s.length as u64;
        if off >= sl {
            off -= sl;
            continue;
        }
        let n = ((sl - off) as usize).min(data.len() - done);
        let span = keys.resolve(s.lkey, pd, s.addr + off, n as u64, access::LOCAL_WRITE).ok_or(WcStatus::LocProtErr)?;
        // SAFETY: resolved for n bytes just now.
        unsafe { span.write(&data[done..done + n]) };
        done += n;
        off = 0;
    }
    if done != data.len() {
        return Err(WcStatus::LocLenErr);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::mem::RegionMemory;

    const PD: u32 = 1;
    const IOVA: u64 = 0x1000;
    const LEN: usize = 4096;

    /// An MR of `owner`'s over a memfd of its own, mapped by itself (not
    /// sealed against growing, so not through a shared window, which a
    /// prefault thread may hold for a while): its last `Arc` unmaps it.
    fn mr(owner: ClientId, key: u32) -> Arc<Mr> {
        let fd = unsafe { libc::memfd_create(c"keys-test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), LEN as libc::off_t) }, 0);
        assert_eq!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
        Arc::new(Mr {
            owner,
            pd: PD,
            key,
            iova: IOVA,
            len: LEN as u64,
            access: access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ,
            mem: RegionMemory::map(&fd, IOVA, &[(0, LEN as u64)]).unwrap(),
            invalidated: AtomicBool::new(false),
            trace: Default::default(),
        })
    }

    /// A namespace holding one foreign alias, `key`, of `memory`.
    fn aliasing(key: u32, memory: ExportedMemory, grant: &Arc<Grant>) -> Keys {
        let mut keys = Keys::default();
        let target = AliasTarget::Foreign(Export { memory, grant: Arc::downgrade(grant) });
        let kind = IndirectKind::Alias { target_key: 0x100, target_owner: 1, target };
        keys.indirect.insert(key, IndirectKey { owner: 2, pd: PD, generation: 1, kind });
        keys
    }

    /// What a packet resolved through a foreign alias stays mapped while
    /// the packet's data is copied, though the target's namespace lets go
    /// of it meanwhile (as its release thread does when it closes); later
    /// packets find the alias stale.
    #[test]
    fn a_foreign_alias_keeps_its_target_mapped_while_a_packet_uses_it() {
        let grant = Arc::new(Grant { grantee: 2 });
        let target = mr(1, 0x100);
        let keys = aliasing(0x200, ExportedMemory::Mr(Arc::downgrade(&target)), &grant);
        let span = keys.resolve(0x200, PD, IOVA, LEN as u64, access::REMOTE_WRITE).expect("a live alias resolves");
        drop(target);
        // SAFETY: resolved for LEN bytes just now.
        unsafe { span.write(&[0xab; LEN]) };
        let mut back = [0u8; LEN];
        unsafe { span.read(&mut back) };
        assert!(back.iter().all(|&b| b == 0xab));
        drop(span);
        assert!(keys.resolve(0x200, PD, IOVA, 8, access::REMOTE_WRITE).is_none(), "the alias is stale");
    }

    /// The same through a foreign alias of a bound indirect key, whose
    /// binding holds its MRs weakly.
    #[test]
    fn a_foreign_alias_of_a_binding_keeps_its_mrs_mapped_while_a_packet_uses_them() {
        let grant = Arc::new(Grant { grantee: 2 });
        let (a, b) = (mr(1, 0x101), mr(1, 0x102));
        let half = LEN as u64 / 2;
        let entries = vec![
            Entry { mr: Arc::downgrade(&a), va: IOVA, len: half, start: 0 },
            Entry { mr: Arc::downgrade(&b), va: IOVA, len: half, start: half },
        ];
        let binding = Arc::new(Binding { iova: 0, len: LEN as u64, access: access::REMOTE_WRITE, entries, lent: false });
        let keys = aliasing(0x200, ExportedMemory::Binding(Arc::downgrade(&binding)), &grant);
        let span = keys.resolve(0x200, PD, 0, LEN as u64, access::REMOTE_WRITE).expect("a live alias resolves");
        drop((a, b, binding));
        // SAFETY: resolved for LEN bytes just now.
        unsafe { span.write(&[0xcd; LEN]) };
        let mut back = [0u8; LEN];
        unsafe { span.read(&mut back) };
        assert!(back.iter().all(|&b| b == 0xcd));
    }
}
