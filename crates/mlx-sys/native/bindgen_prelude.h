/* Seen by bindgen before the mlx-c headers on targets where mlx-c's half.h
 * defines no half types (x86-64). `__fp16` becomes bindgen's
 * `__BindgenFloat16` and `bfloat16_t` a `u16`: the Rust types mlx-rs expects. */
#include <stdint.h>
#define HAS_FLOAT16
#define HAS_BFLOAT16
typedef __fp16 float16_t;
typedef uint16_t bfloat16_t;
