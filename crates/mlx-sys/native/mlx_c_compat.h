/* Force-included (-include) into every C++ file of mlx-c when it is built
 * for mlex. Two gaps between mlx-c 0.7.0 and GCC 12 on x86-64 are closed here:
 *
 * 1. mlx-c's private/io.h calls std::format, which libstdc++ 12 lacks. A
 *    minimal fallback that understands only "{}" placeholders is enough for
 *    its error messages.
 * 2. mlx-c's half.h defines float16_t/bfloat16_t (and HAS_FLOAT16 /
 *    HAS_BFLOAT16, which gate mlx_array_{item,data}_{float16,bfloat16}) only
 *    on ARM; mlx-rs needs those functions everywhere, so alias MLX's own
 *    half types.
 *
 * CMake's compiler probes also see this flag, hence the __has_include guards.
 */
#ifndef MLEX_MLX_C_COMPAT_H
#define MLEX_MLX_C_COMPAT_H
#ifdef __cplusplus

#if __has_include(<format>)
#include <format>
#endif
#if !defined(__cpp_lib_format)
#include <sstream>
#include <string>
#include <string_view>
namespace std {
namespace mlex_detail {
inline void format_into(std::ostringstream& out, std::string_view fmt) {
  out << fmt;
}
template <typename T, typename... Rest>
void format_into(std::ostringstream& out, std::string_view fmt, const T& first,
                 const Rest&... rest) {
  auto pos = fmt.find("{}");
  if (pos == std::string_view::npos) {
    out << fmt;
    return;
  }
  out << fmt.substr(0, pos) << first;
  format_into(out, fmt.substr(pos + 2), rest...);
}
}  // namespace mlex_detail
template <typename... Args>
std::string format(std::string_view fmt, const Args&... args) {
  std::ostringstream out;
  mlex_detail::format_into(out, fmt, args...);
  return out.str();
}
}  // namespace std
#endif

#if !defined(__aarch64__) && __has_include(<mlx/types/half_types.h>)
#include <mlx/types/half_types.h>
typedef mlx::core::float16_t float16_t;
typedef mlx::core::bfloat16_t bfloat16_t;
#define HAS_FLOAT16
#define HAS_BFLOAT16
#endif

#endif /* __cplusplus */
#endif /* MLEX_MLX_C_COMPAT_H */
