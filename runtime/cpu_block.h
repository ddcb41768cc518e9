/* Positions a block of KV: runtime/kv.py's BLOCK, the CPU attention kernels' key block (runtime/cpu_attention.py
   checks the two agree). */

#ifndef KVGATE_CPU_BLOCK_H
#define KVGATE_CPU_BLOCK_H

#define BLOCK 64

#endif
