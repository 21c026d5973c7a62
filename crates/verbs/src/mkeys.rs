//! Memory keys without registration cost (docs/mkeys.md): indirect keys
//! bound and invalidated by work requests, a pool of them, and aliases that
//! let another client of the namespace reach memory it was granted.
//!
//! ```text
//! let pool = KeyPool::new(&pd, 64, 1)?;            // 64 indirect keys, made ahead
//! let k = pool.get(&[mr.sge(off, len)], access::REMOTE_WRITE | access::LOCAL_WRITE)?;
//! // ... peers use k.key() at k.iova() ...
//! drop(k);                                         // invalidated, back in the pool
//! ```

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{anyhow, bail};
use rnic::keys::MAX_KLM;
use rnic::proto::{Reply, Request};
use rnic::ring::{SendWqe, MAX_SGE};

use crate::{send_flags, CompChannel, ConnectOpts, Context, Cq, Mr, Pd, Qp, QpCap, QpInitAttr, Sge, WcStatus, WrOpcode};

/// How long a pool waits for its bind completions.
const BIND_TIMEOUT: Duration = Duration::from_secs(10);

/// An indirect key (like a UMR mkey): no memory of its own; bound to
/// ranges of MRs by [`Qp::post_bind`], destroyed on drop.
pub struct IndirectKey {
    ctx: Context,
    key: u32,
}

impl IndirectKey {
    pub fn key(&self) -> u32 {
        self.key
    }

    /// Follows a rename by a memory window's bind (its new key, in `swap`
    /// of the bind WQE): the key destroyed on drop is the new one.
    pub fn renamed(&mut self, key: u32) {
        self.key = key;
    }
}

impl Drop for IndirectKey {
    fn drop(&mut self) {
        self.ctx.inner.destroy(&Request::DestroyKey { key: self.key });
    }
}

fn create_indirect_key(ctx: &Context, pd: u32, max_entries: u32, key: Option<u32>) -> anyhow::Result<IndirectKey> {
    match ctx.inner.call(&Request::CreateIndirectKey { pd, max_entries, key }, &[])? {
        Reply::Key(key) => Ok(IndirectKey { ctx: ctx.clone(), key }),
        r => bail!("unexpected reply {r:?}"),
    }
}

fn create_alias(ctx: &Context, pd: u32, owner_namespace: Option<Ipv4Addr>, owner: u64, key: u32) -> anyhow::Result<Alias> {
    match ctx.inner.call(&Request::CreateAlias { pd, owner, key, alias: None, owner_namespace }, &[])? {
        Reply::Alias { key: alias, iova, len, access } => Ok(Alias { ctx: ctx.clone(), key: alias, owner, target: key, iova, len, access }),
        r => bail!("unexpected reply {r:?}"),
    }
}

impl Pd {
    /// An indirect key of this PD taking up to `max_entries` ranges per bind
    /// (at most 24, the KLM limit); `key` picks its number.
    pub fn create_indirect_key(&self, max_entries: u32, key: Option<u32>) -> anyhow::Result<IndirectKey> {
        create_indirect_key(&self.ctx, self.handle, max_entries, key)
    }

    /// An alias, in this PD, of client `owner`'s key `key` (which that client
    /// granted to this one): usable as an lkey (or an rkey) while the target
    /// is neither rebound, revoked nor gone.
    pub fn create_alias(&self, owner: u64, key: u32) -> anyhow::Result<Alias> {
        create_alias(&self.ctx, self.handle, None, owner, key)
    }

    /// As `create_alias`, for a key of a client of another namespace
    /// (`namespace`, its GID) of the same rnicd. The alias turns stale in
    /// the same cases, and when that namespace closes.
    pub fn create_alias_in(&self, namespace: Ipv4Addr, owner: u64, key: u32) -> anyhow::Result<Alias> {
        create_alias(&self.ctx, self.handle, Some(namespace), owner, key)
    }
}

/// A key-table work request: bind an indirect key or invalidate it.
#[derive(Clone, Copy, Debug)]
pub enum KeyOp<'a> {
    /// Bind `key` to `ranges` (SGEs of MRs of the QP's PD, at most 24),
    /// seen by users of the key at `iova` with `access`.
    Bind { wr_id: u64, key: u32, iova: u64, access: u32, ranges: &'a [Sge], signaled: bool },
    /// Invalidate `key`: it grants nothing until bound again.
    Invalidate { wr_id: u64, key: u32, signaled: bool },
    /// A memory window's bind: `key` is renamed `new_key` (same family:
    /// only the low byte differs), then bound to `range` (one range of an
    /// MR, which may lend remote rights it lacks if registered with
    /// `access::MW_BIND`) or, without one, left bound to nothing.
    BindWindow { wr_id: u64, key: u32, new_key: u32, iova: u64, access: u32, range: Option<Sge>, signaled: bool },
}

impl KeyOp<'_> {
    pub(crate) fn wqe(&self) -> anyhow::Result<SendWqe> {
        let flags = |signaled: bool| if signaled { send_flags::SIGNALED } else { 0 };
        Ok(match *self {
            KeyOp::Bind { wr_id, key, iova, access, ranges, signaled } => {
                // rnicd refuses lists too long with a completion error; one
                // longer than the WQE can even count is refused here.
                if ranges.len() > u8::MAX as usize {
                    bail!("{} ranges in one bind (rnicd takes {MAX_KLM})", ranges.len());
                }
                let mut w = SendWqe {
                    wr_id,
                    opcode: WrOpcode::BindKey as u8,
                    flags: flags(signaled),
                    remote_addr: iova,
                    rkey: key,
                    compare_add: access as u64,
                    num_sge: ranges.len() as u8,
                    ..Default::default()
                };
                let (direct, rest) = ranges.split_at(ranges.len().min(MAX_SGE));
                w.sge[..direct.len()].copy_from_slice(direct);
                for (slot, s) in w.inline.chunks_exact_mut(16).zip(rest) {
                    slot[..8].copy_from_slice(&s.addr.to_le_bytes());
                    slot[8..12].copy_from_slice(&s.length.to_le_bytes());
                    slot[12..].copy_from_slice(&s.lkey.to_le_bytes());
                }
                w
            }
            KeyOp::Invalidate { wr_id, key, signaled } => {
                SendWqe { wr_id, opcode: WrOpcode::LocalInv as u8, flags: flags(signaled), rkey: key, ..Default::default() }
            }
            KeyOp::BindWindow { wr_id, key, new_key, iova, access, range, signaled } => {
                let mut w = KeyOp::Bind { wr_id, key, iova, access, ranges: range.as_slice(), signaled }.wqe()?;
                w.swap = new_key as u64;
                w
            }
        })
    }
}

impl Qp {
    /// Posts key-table work requests in order, with one doorbell. Each runs
    /// once every earlier WR of this QP completed, and later WRs run after
    /// it; it completes on the send CQ if signaled (always when it fails,
    /// which also moves the QP to ERR, as any failed WR). Fails, posting
    /// the rest no more, when the send queue is full.
    pub fn post_key_ops(&self, ops: &[KeyOp]) -> anyhow::Result<()> {
        let mut ring = self.sq.lock().unwrap_or_else(|e| e.into_inner());
        let mut result = Ok(());
        let mut posted = 0;
        for op in ops {
            match op.wqe() {
                Ok(w) if ring.push(&w) => posted += 1,
                Ok(_) => {
                    result = Err(anyhow!("send queue full"));
                    break;
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.finish_post(ring, posted, true);
        result
    }

    /// Posts one bind (see [`KeyOp::Bind`]).
    pub fn post_bind(&self, wr_id: u64, key: u32, iova: u64, access: u32, ranges: &[Sge], signaled: bool) -> anyhow::Result<()> {
        self.post_key_ops(&[KeyOp::Bind { wr_id, key, iova, access, ranges, signaled }])
    }

    /// Posts one invalidation (see [`KeyOp::Invalidate`]).
    pub fn post_local_inv(&self, wr_id: u64, key: u32, signaled: bool) -> anyhow::Result<()> {
        self.post_key_ops(&[KeyOp::Invalidate { wr_id, key, signaled }])
    }
}

/// A key (an MR or an indirect key) its owner can let other clients alias.
pub trait KeyGrant {
    fn context(&self) -> &Context;
    fn granted_key(&self) -> u32;

    /// Lets client `grantee` (its [`Context::client_id`], unique in the
    /// rnicd) alias this key, from this namespace or another.
    fn grant(&self, grantee: u64) -> anyhow::Result<()> {
        ok(self.context().inner.call(&Request::GrantKey { key: self.granted_key(), grantee }, &[])?)
    }

    /// Takes the grant back: the grantee's aliases turn stale at once.
    fn revoke(&self, grantee: u64) -> anyhow::Result<()> {
        ok(self.context().inner.call(&Request::RevokeKey { key: self.granted_key(), grantee }, &[])?)
    }
}

fn ok(r: Reply) -> anyhow::Result<()> {
    match r {
        Reply::Ok => Ok(()),
        r => Err(anyhow!("unexpected reply {r:?}")),
    }
}

impl KeyGrant for Mr {
    fn context(&self) -> &Context {
        &self.ctx
    }
    fn granted_key(&self) -> u32 {
        self.lkey
    }
}

impl KeyGrant for IndirectKey {
    fn context(&self) -> &Context {
        &self.ctx
    }
    fn granted_key(&self) -> u32 {
        self.key
    }
}

/// Another client's memory seen through a key of ours (cross-client key).
pub struct Alias {
    ctx: Context,
    pub key: u32,
    /// The owner (client ID) and its key this alias reaches.
    pub owner: u64,
    pub target: u32,
    /// The target's range and access when the alias was made.
    pub iova: u64,
    pub len: u64,
    pub access: u32,
}

impl Alias {
    /// An SGE of `len` bytes at offset `off` of the target's range.
    pub fn sge(&self, off: u64, len: u32) -> Sge {
        Sge { addr: self.iova + off, length: len, lkey: self.key }
    }

    /// Whether the alias still reaches what it was made for (asks rnicd;
    /// rnicd checks the same at every use and refuses a stale alias).
    pub fn is_live(&self) -> anyhow::Result<bool> {
        match self.ctx.inner.call(&Request::QueryAlias { key: self.key }, &[])? {
            Reply::AliasState { live } => Ok(live),
            r => bail!("unexpected reply {r:?}"),
        }
    }
}

impl Drop for Alias {
    fn drop(&mut self) {
        self.ctx.inner.destroy(&Request::DestroyKey { key: self.key });
    }
}

/// Aliases made once and kept, keyed by `owner << 32 | key` as the seed's
/// cross-GVMI mkey map is. A stale alias is never handed out by
/// [`AliasCache::get_checked`] and is dropped by [`AliasCache::forget`]
/// when a use of it failed (rnicd refuses stale aliases at use time, so an
/// unchecked `get` costs at worst one failed operation, never a wrong one).
pub struct AliasCache {
    ctx: Context,
    pd: u32,
    /// The owners' namespace, when not this cache's.
    owner_namespace: Option<Ipv4Addr>,
    map: Mutex<HashMap<u64, std::sync::Arc<Alias>>>,
}

impl AliasCache {
    /// A cache of aliases of keys of this PD's namespace.
    pub fn new(pd: &Pd) -> anyhow::Result<AliasCache> {
        Ok(AliasCache { ctx: pd.ctx.clone(), pd: pd.handle, owner_namespace: None, map: Mutex::new(HashMap::new()) })
    }

    /// A cache of aliases of keys of clients of namespace `owner_namespace`
    /// (a GID of the same rnicd), made in this PD (cross-namespace keys, as
    /// the seed's cross-GVMI mkeys).
    pub fn of_namespace(pd: &Pd, owner_namespace: Ipv4Addr) -> anyhow::Result<AliasCache> {
        let owner_namespace = (owner_namespace != pd.ctx.gid()).then_some(owner_namespace);
        Ok(AliasCache { ctx: pd.ctx.clone(), pd: pd.handle, owner_namespace, map: Mutex::new(HashMap::new()) })
    }

    fn slot(owner: u64, key: u32) -> u64 {
        owner << 32 | key as u64
    }

    /// The cached alias of `owner`'s `key`, made on first use.
    pub fn get(&self, owner: u64, key: u32) -> anyhow::Result<std::sync::Arc<Alias>> {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = m.get(&Self::slot(owner, key)) {
            return Ok(a.clone());
        }
        let a = std::sync::Arc::new(create_alias(&self.ctx, self.pd, self.owner_namespace, owner, key)?);
        m.insert(Self::slot(owner, key), a.clone());
        Ok(a)
    }

    /// As `get`, but a cached alias found stale (its owner rebound, revoked
    /// or died) is dropped and made again (which fails if the owner no
    /// longer grants the key).
    pub fn get_checked(&self, owner: u64, key: u32) -> anyhow::Result<std::sync::Arc<Alias>> {
        let a = self.get(owner, key)?;
        if a.is_live()? {
            return Ok(a);
        }
        self.forget(owner, key);
        self.get(owner, key)
    }

    /// Drops the cached alias of `owner`'s `key` (after a failed use).
    pub fn forget(&self, owner: u64, key: u32) {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).remove(&Self::slot(owner, key));
    }

    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Indirect keys created ahead (or on first use when the pool runs dry),
/// bound on a QP of the pool's own (connected to itself: binds never touch
/// the wire) and handed out; dropping a [`PooledKey`] invalidates it and
/// returns it to the pool.
pub struct KeyPool {
    ctx: Context,
    pd: u32,
    max_entries: u32,
    free: Mutex<Vec<IndirectKey>>,
    qp: Qp,
    cq: Cq,
    /// The pool sleeps on its CQ's channel while rnicd runs its binds: on
    /// a small host a spinning waiter takes the CPU rnicd needs.
    channel: CompChannel,
    /// Serialises bind-and-wait on the pool's QP.
    lock: Mutex<u64>,
    created: std::sync::atomic::AtomicUsize,
}

/// Depth of the pool's bind queue.
const POOL_QUEUE: u32 = 1024;

impl KeyPool {
    /// A pool of `ahead` keys made now, each taking up to `max_entries` ranges.
    pub fn new(pd: &Pd, ahead: usize, max_entries: u32) -> anyhow::Result<KeyPool> {
        let ctx = pd.context().clone();
        let channel = ctx.create_comp_channel()?;
        let cq = ctx.create_cq(POOL_QUEUE.next_power_of_two() * 2, Some(&channel))?;
        let mut init = QpInitAttr::new(&cq, &cq);
        init.cap = QpCap { max_send_wr: POOL_QUEUE, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let qp = pd.create_qp(&init)?;
        qp.connect(&qp.endpoint(0), &ConnectOpts::default())?;
        let mut free = Vec::with_capacity(ahead);
        for _ in 0..ahead {
            free.push(create_indirect_key(&ctx, pd.handle, max_entries, None)?);
        }
        Ok(KeyPool {
            ctx,
            pd: pd.handle,
            max_entries,
            free: Mutex::new(free),
            qp,
            cq,
            channel,
            lock: Mutex::new(0),
            created: std::sync::atomic::AtomicUsize::new(ahead),
        })
    }

    /// Keys made so far (ahead and on demand).
    pub fn created(&self) -> usize {
        self.created.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Keys waiting in the pool.
    pub fn available(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// A key bound to `ranges` (seen at the first range's address) with
    /// `access`, ready when this returns.
    pub fn get(&self, ranges: &[Sge], access: u32) -> anyhow::Result<PooledKey<'_>> {
        self.get_at(ranges, ranges.first().map_or(0, |r| r.addr), access)
    }

    /// As `get`, with the ranges seen at `iova`.
    pub fn get_at(&self, ranges: &[Sge], iova: u64, access: u32) -> anyhow::Result<PooledKey<'_>> {
        let key = match self.free.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            Some(k) => k,
            None => {
                self.created.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                create_indirect_key(&self.ctx, self.pd, self.max_entries, None)?
            }
        };
        let pk = PooledKey { pool: self, key: Some(key), iova, len: ranges.iter().map(|r| r.length as u64).sum() };
        pk.bind(ranges, iova, access)?;
        Ok(pk)
    }

    /// Several keys at once, each bound to its ranges (seen at the first
    /// range's address), with one wait: the binds ride back to back on the
    /// pool's queue and only the last is signaled.
    pub fn get_many(&self, lists: &[&[Sge]], access: u32) -> anyhow::Result<Vec<PooledKey<'_>>> {
        let mut keys = Vec::with_capacity(lists.len());
        for ranges in lists {
            let key = match self.free.lock().unwrap_or_else(|e| e.into_inner()).pop() {
                Some(k) => k,
                None => {
                    self.created.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    create_indirect_key(&self.ctx, self.pd, self.max_entries, None)?
                }
            };
            let iova = ranges.first().map_or(0, |r| r.addr);
            keys.push(PooledKey { pool: self, key: Some(key), iova, len: ranges.iter().map(|r| r.length as u64).sum() });
        }
        let ops: Vec<KeyOp> = keys
            .iter()
            .zip(lists)
            .enumerate()
            .map(|(i, (k, ranges))| KeyOp::Bind { wr_id: 0, key: k.key(), iova: k.iova, access, ranges, signaled: i + 1 == lists.len() })
            .collect();
        if !ops.is_empty() {
            self.run(|qp, _| qp.post_key_ops(&ops))?;
        }
        Ok(keys)
    }

    /// Returns several keys with one wait (each invalidated first).
    pub fn put_many(&self, mut keys: Vec<PooledKey<'_>>) -> anyhow::Result<()> {
        let taken: Vec<IndirectKey> = keys.iter_mut().filter_map(|k| k.key.take()).collect();
        let ops: Vec<KeyOp> =
            taken.iter().enumerate().map(|(i, k)| KeyOp::Invalidate { wr_id: 0, key: k.key, signaled: i + 1 == taken.len() }).collect();
        if !ops.is_empty() {
            self.run(|qp, _| qp.post_key_ops(&ops))?;
        }
        self.free.lock().unwrap_or_else(|e| e.into_inner()).extend(taken);
        Ok(())
    }

    /// Posts `wrs` binds/invalidations (the last one signaled) and waits for it.
    fn run(&self, post: impl FnOnce(&Qp, u64) -> anyhow::Result<()>) -> anyhow::Result<()> {
        let mut id = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        *id += 1;
        post(&self.qp, *id)?;
        let wc = self.wait_one()?;
        if wc.status != WcStatus::Success {
            bail!("bind work request failed: {:?}", wc.status);
        }
        Ok(())
    }

    /// The next completion of the pool's QP: a short spin, then asleep on the channel.
    fn wait_one(&self) -> anyhow::Result<crate::Wc> {
        let mut wc = [crate::Wc::default()];
        if self.cq.poll_or_wait(&mut wc, &self.channel, Duration::from_micros(20), BIND_TIMEOUT)? == 0 {
            bail!("no bind completion within {BIND_TIMEOUT:?}");
        }
        Ok(wc[0])
    }

    /// Binds (and then invalidates) `key` `n` times back to back, the last
    /// invalidation signaled: the pipelined cost of a rebind (benchmarks).
    pub fn churn(&self, key: &IndirectKey, ranges: &[Sge], access: u32, n: usize) -> anyhow::Result<()> {
        let iova = ranges.first().map_or(0, |r| r.addr);
        let mut id = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut left = n;
        while left > 0 {
            let batch = left.min(POOL_QUEUE as usize / 2);
            let mut ops = Vec::with_capacity(2 * batch);
            for i in 0..batch {
                *id += 1;
                ops.push(KeyOp::Bind { wr_id: *id, key: key.key, iova, access, ranges, signaled: false });
                ops.push(KeyOp::Invalidate { wr_id: *id, key: key.key, signaled: i + 1 == batch });
            }
            self.qp.post_key_ops(&ops)?;
            let wc = self.wait_one()?;
            if wc.status != WcStatus::Success {
                bail!("bind work request failed: {:?}", wc.status);
            }
            left -= batch;
        }
        Ok(())
    }

    /// A bare key of the pool's PD (not handed out): for `churn`.
    pub fn make_key(&self) -> anyhow::Result<IndirectKey> {
        create_indirect_key(&self.ctx, self.pd, self.max_entries, None)
    }
}

/// A key taken from a [`KeyPool`].
pub struct PooledKey<'a> {
    pool: &'a KeyPool,
    key: Option<IndirectKey>,
    iova: u64,
    len: u64,
}

impl PooledKey<'_> {
    /// The lkey = rkey.
    pub fn key(&self) -> u32 {
        self.key.as_ref().map_or(0, |k| k.key)
    }
    /// Where the bound range starts for users of the key.
    pub fn iova(&self) -> u64 {
        self.iova
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn indirect(&self) -> &IndirectKey {
        self.key.as_ref().expect("a pooled key is present until dropped")
    }

    /// Binds the key to other ranges (seen at the first one's address).
    pub fn rebind(&mut self, ranges: &[Sge], access: u32) -> anyhow::Result<()> {
        self.rebind_at(ranges, ranges.first().map_or(0, |r| r.addr), access)
    }

    /// Binds the key to other ranges, seen at `iova`.
    pub fn rebind_at(&mut self, ranges: &[Sge], iova: u64, access: u32) -> anyhow::Result<()> {
        self.bind(ranges, iova, access)?;
        self.iova = iova;
        self.len = ranges.iter().map(|r| r.length as u64).sum();
        Ok(())
    }

    fn bind(&self, ranges: &[Sge], iova: u64, access: u32) -> anyhow::Result<()> {
        let key = self.key();
        self.pool.run(|qp, id| qp.post_bind(id, key, iova, access, ranges, true))
    }

    /// Invalidates the key now (it grants nothing until rebound).
    pub fn invalidate(&self) -> anyhow::Result<()> {
        let key = self.key();
        self.pool.run(|qp, id| qp.post_local_inv(id, key, true))
    }
}

impl Drop for PooledKey<'_> {
    fn drop(&mut self) {
        let Some(k) = self.key.take() else { return };
        // Back in the pool only once nothing can reach memory through it.
        if self.invalidate_key(&k).is_ok() {
            self.pool.free.lock().unwrap_or_else(|e| e.into_inner()).push(k);
        }
    }
}

impl PooledKey<'_> {
    fn invalidate_key(&self, k: &IndirectKey) -> anyhow::Result<()> {
        let key = k.key;
        self.pool.run(|qp, id| qp.post_local_inv(id, key, true))
    }
}
